"""FastServe Fig. 11(b) on the simulator: OPT-66B on 4 x A100-40GB (tensor parallel), latency vs
request rate on ShareGPT and Alpaca, for vLLM's fcfs, FastServe's skip-join-mlfq and ALISE's
srpt-predicted.

Protocol, fixed before any run:

- Cost model `opt-66b@a100-40gb:tp4`: every GPU holds a quarter of the weights (32.8 GB) and of
  the KV, and each iteration pays Megatron-style all-reduces over NVLink (RooflineCostModel,
  `tp_comm_seconds`). Device KV pool: what is left beside the weights in 90% of each GPU
  (`kv_capacity_tokens()`, ~5.3k tokens, 16-token blocks), so memory binds as in the paper; host
  tier 4x the device pool.
- Policies with their papers' memory modes: fcfs / recompute (vLLM), skip-join-mlfq /
  proactive-swap (FastServe §4.2), srpt-predicted / proactive-swap (ALISE, lengths from the real
  predictor). Batch 16 (the scheduling benchmarks' setup), other settings at their defaults.
- Workloads: the held-out records of sched_predicted.py's split (Alpaca: 500 of alpaca_4500.json;
  ShareGPT: first human->gpt pairs of 200 conversations of sharegpt_multiturn_800.json — the
  first-turn file holds prompts only, no output lengths), GPT-2 (OPT) token counts, vLLM's length
  filter; the predictors are built on the other records (`sched_predicted.py prepare`, run here if
  missing). N = 1,000 requests, Poisson arrivals, seed 0.
- Rates: fractions LOADS of fcfs's saturation throughput on the same setup (every request at t=0),
  reported in req/s. SLO: mean normalized latency <= 10x the decode iteration time (docs/DESIGN.md
  paper protocol); max rate under the SLO interpolated per policy.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/fastserve_fig11b.py          # ~4 min
    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/fastserve_fig11b.py --report-only        # from results/

Results: benchmarks/scheduling/results/fastserve_fig11b_n1000.json (one docs/DESIGN.md results file per dataset
under "datasets"), benchmarks/scheduling/figures/fastserve_fig11b.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tokenslice.sim.simulate import SweepSpec
from tokenslice.predict.cost import load_cost_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import (  # noqa: E402
    DATASETS, Runner, code_version, fmt, log, max_rate, md_table, read_json, save_figure, write_json)
from sched_predicted import SPLITS, held_out_file, prepare  # noqa: E402

PROFILE = "opt-66b@a100-40gb:tp4"
VARIANTS = [("fcfs", "recompute"), ("skip-join-mlfq", "proactive-swap"), ("srpt-predicted", "proactive-swap")]
LOADS = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0]
SEED = 0
BLOCK = 16


def file_name(n: int) -> str:
    return f"fastserve_fig11b_n{n}.json"


def runner(dataset: str, policy: str, preemption: str, n: int, profile: str = PROFILE, cv: float = 1.0,
           seeds: tuple[int, ...] = (SEED,)) -> Runner:
    """`cv`: of the inter-arrival times (1: Poisson)."""
    cost = load_cost_model(profile)
    cost.check_fits()
    spec = SweepSpec(workload=dataset, policies=[policy], preemption=preemption, rates=[1.0], seeds=list(seeds), cv=cv,
                     num_requests=n, max_batch_size=16, kv_cache_blocks=cost.kv_capacity_tokens() // BLOCK,
                     block_size=BLOCK, **{**DATASETS[dataset], "dataset": str(held_out_file(dataset))},
                     length_predictor=str(SPLITS[dataset][2]) if policy == "srpt-predicted" else None)
    return Runner(spec, cost)


def simulate(dataset: str, n: int, profile: str = PROFILE) -> dict[str, Any]:
    runners = {policy: runner(dataset, policy, preemption, n, profile) for policy, preemption in VARIANTS}
    sat = runners["fcfs"].saturation(SEED)
    rates = [round(sat * x, 4) for x in LOADS]
    log(f"{dataset}: fcfs saturation {sat:.3f} req/s; rates {rates}")
    runs = []
    for policy, r in runners.items():
        for rate in rates:
            run = dict(r.run(policy, rate, SEED))
            run["load"] = rate / sat  # of fcfs/recompute's saturation, the same for every policy
            run.pop("tbt_cdf", None)
            runs.append(run)
    res = runners["fcfs"].results()
    res["runs"] = runs
    res["workload"]["kv_memory"] = {"device_blocks": runners["fcfs"].kv_blocks, "block_size": BLOCK,
                                    "host_blocks_per_device_block": 4}
    res["workload"]["memory_modes"] = dict(VARIANTS)
    slo = runners["fcfs"].slo
    detail = {p: max_rate([(x["rate"], x["metrics"]["mean_normalized_latency"]) for x in runs if x["policy"] == p],
                          slo) for p, _ in VARIANTS}
    res["summary"] = {"fcfs_saturation_rps": sat, "max_rate_under_slo": {p: d[0] for p, d in detail.items()},
                      "max_rate_censored": sorted(p for p, d in detail.items() if d[1])}
    return res


def table(name: str, res: dict[str, Any]) -> str:
    by = {(r["policy"], round(r["rate"], 4)): r["metrics"] for r in res["runs"]}
    rates = sorted({k[1] for k in by})
    policies = [p for p, _ in VARIANTS]
    rows = []
    for rate in rates:
        row: list[Any] = [f"{rate:g}", f"{rate / res['summary']['fcfs_saturation_rps']:.2f}"]
        for p in policies:
            m = by[(p, rate)]
            row += [fmt(m["mean_normalized_latency"]), fmt(m["mean_jct"], 3)]
        rows.append(row)
    head = ["rate (req/s)", "load"] + [f"{p} {k}" for p in policies for k in ("s/tok", "JCT s")]
    slo = res["slo"]["mean_normalized_latency"]
    mr = res["summary"]["max_rate_under_slo"]
    fcfs = mr["fcfs"]
    censored = res["summary"]["max_rate_censored"]  # within the SLO at the highest rate
    lines = [f"## {name}: {res['workload']['num_requests']} requests, SLO {slo:.4g} s/token, "
             f"fcfs saturation {res['summary']['fcfs_saturation_rps']:.3f} req/s", "",
             md_table(head, rows), "",
             "max rate under the SLO: " + ", ".join(
                 f"{p} {'>= ' if p in censored else ''}{fmt(mr[p])} req/s ({fmt(mr[p] / fcfs if fcfs else None, 3)}x fcfs)"
                 for p in policies)]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], profile: str = PROFILE, file: str = "fastserve_fig11b.png") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4))
    for ax, (name, res) in zip(axes, results.items()):
        for policy, preemption in VARIANTS:
            pts = sorted((r["rate"], r["metrics"]["mean_normalized_latency"]) for r in res["runs"]
                         if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy} ({preemption})")
        ax.axhline(res["slo"]["mean_normalized_latency"], color="grey", ls="--", lw=1, label="SLO")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title(f"{name}, {profile}")
        ax.legend(fontsize=8)
    return save_figure(fig, file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--report-only", action="store_true", help="print the tables from the results file")
    a = ap.parse_args()
    if a.report_only:
        out = read_json(file_name(a.num_requests))
    else:
        t0 = time.perf_counter()
        data = prepare()
        results = {name: simulate(name, a.num_requests) for name in ("sharegpt", "alpaca")}
        out = {"profile": PROFILE, "datasets": results, "held_out": data, "code": code_version(),
               "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - t0,
               "command": "PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/fastserve_fig11b.py "
                          f"--num-requests {a.num_requests}"}
        write_json(file_name(a.num_requests), out)
        log(f"wrote {plot(results)}")
    for name, res in out["datasets"].items():
        print(table(name, res) + "\n")


if __name__ == "__main__":
    main()
