"""FastServe Fig. 11(c) on the simulator: OPT-175B on 16 x A100-40GB — two p4d.24xlarge nodes,
tensor parallel over each node's 8 GPUs, pipeline parallel (2 stages) across the nodes — latency
vs request rate on ShareGPT and Alpaca for vLLM's fcfs, FastServe's skip-join-mlfq and ALISE's
srpt-predicted.

Protocol, fixed before any run (fastserve_fig11b.py's, on the larger setting):

- Cost model `opt-175b@a100-40gb:tp8:pp2`: every GPU holds 1/16 of the weights (21.8 GB) and of
  the KV; each stage computes 48 layers with Megatron all-reduces over NVLink, and a batch's
  activations cross to the other node over p4d's 400 Gb/s EFA (RooflineCostModel `stage_seconds`,
  `p2p_seconds`). The pipelined simulator keeps 2 batches in flight; the scheduler never puts a
  request whose token is in the pipe into the other batch (FastServe §4.3). Device KV pool: what
  is left beside the weights in 90% of each GPU (`kv_capacity_tokens()`, 16-token blocks); host
  tier 4x that.
- Policies with their papers' memory modes, batch 16 per micro-batch, lengths, datasets,
  predictors and held-out records exactly as fastserve_fig11b.py.
- Paper protocol: N = 1,000, Poisson, seed 0, rates = fractions LOADS of fcfs's saturation
  throughput; SLO mean normalized latency <= 10x the decode iteration (here a whole pass down
  the pipe); max rate under the SLO interpolated per policy.
- Steady-state protocol (docs/DESIGN.md), cut to fit the time budget: N = 4,000 (docs/DESIGN.md asks
  >= 8,000: `--steady-requests 8000`, about twice the time), seed 0, both datasets, Gamma CV = 4 arrivals at rho = 0.8 and 0.95 of fcfs's saturation (measured at that
  N) and Poisson at rho = 0.95; mean and p95 normalized latency, mean and p99 TTFT, p99.9 TBT,
  ratios against fcfs (srpt-oracle is not among this figure's policies).
- Runs are independent simulations, spread over `--jobs` processes (default: every core).

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/fastserve_fig11c.py          # ~10 min, 2 quiet cores
    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/fastserve_fig11c.py --report-only        # from results/

Results: benchmarks/scheduling/results/fastserve_fig11c_n1000_s4000.json,
benchmarks/scheduling/figures/fastserve_fig11c.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from fastserve_fig11b import LOADS, SEED, VARIANTS, plot, runner, simulate, table  # noqa: E402
from sched_common import code_version, fmt, log, md_table, read_json, write_json  # noqa: E402
from sched_predicted import prepare  # noqa: E402


PROFILE = "opt-175b@a100-40gb:tp8:pp2"
STEADY_CELLS = [(4.0, 0.8), (4.0, 0.95), (1.0, 0.95)]  # (cv, rho)
STEADY_METRICS = [("mean norm s/tok", "mean_normalized_latency", 1.0), ("p95 norm s/tok", "p95_normalized_latency", 1.0),
                  ("mean TTFT s", "mean_ttft", 1.0), ("p99 TTFT s", "p99_ttft", 1.0), ("p99.9 TBT ms", "p999_tbt", 1e3)]
DATASETS = ("sharegpt", "alpaca")


def file_name(n: int, steady_n: int) -> str:
    return f"fastserve_fig11c_n{n}_s{steady_n}.json"


def steady_saturation(dataset: str, n: int) -> float:
    """fcfs's saturation throughput with every one of the N requests at t = 0 (any cv: the same
    at-once workload)."""
    return runner(dataset, "fcfs", "recompute", n, PROFILE).saturation(SEED)


def steady_run(dataset: str, n: int, policy: str, preemption: str, cv: float, rho: float, sat: float) -> dict[str, Any]:
    """One steady-state simulation at rho x fcfs's saturation `sat`."""
    r = runner(dataset, policy, preemption, n, PROFILE, cv)
    r.set_saturation(SEED, sat)
    run = dict(r.run(policy, rho * sat, SEED))
    run.pop("tbt_cdf", None)
    run["load"], run["saturation_rps"] = rho, sat
    return run


def run_all(n: int, steady_n: int, jobs: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The paper protocol per dataset and the steady-state cells, `jobs` simulations at a time."""
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        paper = {d: pool.submit(simulate, d, n, PROFILE) for d in DATASETS}
        sats = {d: pool.submit(steady_saturation, d, steady_n) for d in DATASETS}
        cells = {d: [pool.submit(steady_run, d, steady_n, policy, preemption, cv, rho, sats[d].result())
                     for cv, rho in STEADY_CELLS for policy, preemption in VARIANTS] for d in DATASETS}
        return ({d: f.result() for d, f in paper.items()},
                {d: [f.result() for f in fs] for d, fs in cells.items()})


def steady_table(name: str, runs: list[dict[str, Any]]) -> str:
    rows = []
    for cv, rho in STEADY_CELLS:
        cell = {r["policy"]: r["metrics"] for r in runs if r["cv"] == cv and r["load"] == rho}
        for policy, _ in VARIANTS:
            m, base = cell[policy], cell["fcfs"]
            row: list[Any] = ["Poisson" if cv == 1.0 else f"CV {cv:g}", f"{rho:g}", policy]
            for _, key, scale in STEADY_METRICS:
                v, b = m[key], base[key]
                ratio = "" if policy == "fcfs" or not b or v is None else f" ({v / b:.2f}x)"
                row.append(fmt(v * scale if v is not None else None, 3) + ratio)
            rows.append(row)
    first = runs[0]
    return (f"### {name}, steady state: N = {first['num_requests']}, seed {SEED}, fcfs saturation "
            f"{first['saturation_rps']:.3f} req/s\n\n" + md_table(["arrivals", "rho", "policy"] +
                                                                [c for c, _, _ in STEADY_METRICS], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000, help="paper protocol's N")
    ap.add_argument("--steady-requests", type=int, default=4000, help="steady-state protocol's N")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations at a time")
    ap.add_argument("--report-only", action="store_true", help="print the tables from the results file")
    a = ap.parse_args()
    name = file_name(a.num_requests, a.steady_requests)
    if a.report_only:
        out = read_json(name)
    else:
        t0 = time.perf_counter()
        data = prepare()
        paper, steady_runs = run_all(a.num_requests, a.steady_requests, max(1, a.jobs))
        out = {"profile": PROFILE, "datasets": paper, "steady_state": steady_runs, "held_out": data,
               "loads": LOADS, "code": code_version(), "date": time.strftime("%Y-%m-%d"),
               "wall_s": time.perf_counter() - t0,
               "command": "PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/fastserve_fig11c.py "
                          f"--num-requests {a.num_requests} --steady-requests {a.steady_requests}"}
        write_json(name, out)
        log(f"wrote {plot(paper, PROFILE, 'fastserve_fig11c.png')}; {out['wall_s']:.0f} s wall")
    for ds, res in out["datasets"].items():
        print(table(ds, res) + "\n")
    for ds, runs in out["steady_state"].items():
        print(steady_table(ds, runs) + "\n")


if __name__ == "__main__":
    main()
