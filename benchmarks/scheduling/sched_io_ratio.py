"""Scheduling benchmarks, part 3: FastServe Fig. 14 on the simulator - the input:output length ratio.

ShareGPT lengths rescaled to mean(input) / mean(output) = R with the mean total kept
(`--io-ratio R`), R = 0.25, 1, 4, 16, 64, 256; policies fcfs, fixed-priority, mlfq,
skip-join-mlfq. Fixed load: rho = 0.8 of fcfs's saturation throughput measured at each ratio
(the work per request changes with R even at a constant token total: prefill tokens are far
cheaper than decode steps), Poisson arrivals, N = 2,000, seeds 0 and 1. Latency is each policy's
mean normalized latency divided by the slowest of the four at that ratio (Fig. 14's y axis).

    nice -n 19 .venv/bin/python benchmarks/scheduling/sched_io_ratio.py
    .venv/bin/python benchmarks/scheduling/sched_io_ratio.py --report-only
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.sim.simulate import run_sweep
from tokenslice.sched.mlfq import QUANTUM_SLACK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import (  # noqa: E402
    CACHE, CLI_DATASET, COST, save_figure, PROFILE, code_version, compact, fmt, log, make_spec,
    md_table, read_json, seed_mean, verdict, write_json)

RATIOS = [0.25, 1, 4, 16, 64, 256]
POLICIES = ["fcfs", "fixed-priority", "mlfq", "skip-join-mlfq"]
SEEDS = [0, 1]
LOAD = 0.8
N = 2000
WITHIN = 1.10  # target: skip-join best or within 10% of the best


def cli_command(ratio: float, n: int) -> str:
    return (f"nice -n 19 .venv/bin/tokenslice simulate --profile {PROFILE} {CLI_DATASET['sharegpt']} "
            f"--io-ratio {ratio:g} --policy {','.join(POLICIES)} --loads {LOAD:g} --cv 1 --seeds 0,1 "
            f"--num-requests {n} --max-batch-size 16")


def workload_diagnostics(ratio: float, n: int) -> dict[str, Any]:
    """What skip-join sees: each request's first-iteration (prefill) time against q1, and how much
    of the work is prefill."""
    spec = make_spec("sharegpt", policies=["fcfs"], loads=[LOAD], io_ratio=ratio, seeds=SEEDS, num_requests=n)
    wl = spec.make(0, None, CACHE)
    q1 = COST.min_iteration_seconds()
    p = np.array([w.prompt_len for w in wl])
    o = np.array([w.output_len for w in wl])
    first = np.array([COST.first_iteration_seconds(int(x)) for x in p])
    decode1 = COST.decode_seconds(1, 1)
    # Skip-join's entry queue: the first whose quantum q1 * 2^i covers the prefill (with slack).
    level = np.maximum(0, np.ceil(np.log2(np.maximum(first / (1 + QUANTUM_SLACK) / q1, 1.0)))).astype(int)
    decode16 = np.array([COST.decode_seconds(16, int(x)) for x in (p + o / 2)])  # a full batch's step at mid-output
    return {"prompt_mean": float(p.mean()), "output_mean": float(o.mean()), "prompt_p99": float(np.percentile(p, 99)),
            "prompt_max": int(p.max()), "output_median": float(np.median(o)),
            "prefill_s_mean": float(first.mean()), "prefill_s_p99": float(np.percentile(first, 99)),
            "prefill_s_max": float(first.max()), "q1_s": q1, "decode1_s": decode1,
            "share_above_q1": float((level > 0).mean()), "entry_level_mean": float(level.mean()),
            "entry_level_max": int(level.max()),
            "chunked_share": float((p > spec.max_tokens_per_step).mean()),
            # Per-request service if it ran alone: prefill + output decode steps of a full batch / 16.
            "prefill_work_share": float(first.sum() / (first.sum() + (o * decode16 / 16).sum()))}


def simulate(ratio: float, n: int) -> dict[str, Any]:
    spec = make_spec("sharegpt", policies=POLICIES, loads=[LOAD], cv=1.0, io_ratio=ratio, seeds=SEEDS, num_requests=n)
    t0 = time.perf_counter()
    last = [t0]
    walls: list[float] = []

    def tick(desc: str) -> None:
        now = time.perf_counter()
        walls.append(now - last[0])
        last[0] = now
        log(f"  R={ratio:g} {desc}: {walls[-1]:.1f} s wall")

    res = compact(run_sweep(COST, spec, profile_name=PROFILE, cache=CACHE, progress=tick))
    for run, w in zip(res["runs"], walls[len(SEEDS):], strict=True):
        run["metrics"]["sim_wall_s"] = w
        run.pop("tbt_cdf", None)
    res["benchmark"] = {"io_ratio": ratio, "command": cli_command(ratio, n), "wall_s": time.perf_counter() - t0,
                        "diagnostics": workload_diagnostics(ratio, n), "code": code_version(),
                        "date": time.strftime("%Y-%m-%d")}
    return res


def per_policy(res: Mapping[str, Any], metric: str) -> dict[str, tuple[float | None, list[float | None]]]:
    return {p: seed_mean(sorted((r for r in res["runs"] if r["policy"] == p), key=lambda r: r["seed"]), metric)
            for p in POLICIES}


def jobs_in_system(res: Mapping[str, Any], policy: str) -> float:
    """Mean number of requests in the system (Little's law: arrival rate x mean e2e latency), seed mean.
    Below the batch size (16) every live job runs every step and the order barely matters."""
    return float(np.mean([r["rate"] * r["metrics"]["mean_jct"] for r in res["runs"] if r["policy"] == policy]))


def tables(all_res: Mapping[str, Mapping[str, Any]]) -> str:
    out = []
    rows, gap_rows, diag_rows, detail_rows = [], [], [], []
    for key, res in all_res.items():
        ratio = res["benchmark"]["io_ratio"]
        lat = per_policy(res, "mean_normalized_latency")
        vals = {p: v[0] for p, v in lat.items()}
        slowest = max(vals.values())
        best = min(vals.values())
        sj = vals["skip-join-mlfq"]
        rows.append([f"{ratio:g}"] + [fmt(vals[p] / slowest, 3) for p in POLICIES] +
                    [fmt(sj / best, 3), verdict(sj / best, WITHIN)])
        per_seed_mlfq = [m / s for m, s in zip(lat["mlfq"][1], lat["skip-join-mlfq"][1])]
        per_seed_fp = [m / s for m, s in zip(lat["fixed-priority"][1], lat["skip-join-mlfq"][1])]
        gap_rows.append([f"{ratio:g}", fmt(vals["mlfq"] / sj, 4), ", ".join(fmt(x, 4) for x in per_seed_mlfq),
                         fmt(vals["fixed-priority"] / sj, 3), ", ".join(fmt(x, 3) for x in per_seed_fp),
                         fmt(vals["fcfs"] / sj, 3)])
        d = res["benchmark"]["diagnostics"]
        sat = res["summary"]["fcfs_saturation_rps"]
        diag_rows.append([f"{ratio:g}", fmt(d["prompt_mean"], 4), fmt(d["output_mean"], 4), d["prompt_max"],
                          fmt(sat, 4), fmt(d["prefill_s_mean"] * 1e3, 3), fmt(d["prefill_s_max"] * 1e3, 4),
                          f"{100 * d['share_above_q1']:.1f}%", fmt(d["entry_level_mean"], 3), d["entry_level_max"],
                          f"{100 * d['chunked_share']:.1f}%", f"{100 * d['prefill_work_share']:.1f}%",
                          fmt(jobs_in_system(res, "fcfs"), 3), fmt(jobs_in_system(res, "skip-join-mlfq"), 3),
                          fmt(res["benchmark"]["wall_s"], 3)])
        metrics = {m: per_policy(res, m) for m in ("mean_normalized_latency", "p95_normalized_latency", "mean_ttft",
                                                   "p99_ttft", "p999_tbt", "preemptions", "throughput_rps")}
        for p in POLICIES:
            detail_rows.append([f"{ratio:g}", p] + [
                f"{fmt(metrics[m][p][0] * sc, 4)} ({', '.join(fmt(v * sc, 3) for v in metrics[m][p][1])})"
                for m, sc in (("mean_normalized_latency", 1), ("p95_normalized_latency", 1), ("mean_ttft", 1),
                              ("p99_ttft", 1), ("p999_tbt", 1e3))] +
                [fmt(metrics["preemptions"][p][0], 4), fmt(metrics["throughput_rps"][p][0], 4)])
    out.append("## Normalized latency (mean normalized latency / the slowest of the four at each ratio)\n")
    out.append(md_table(["in:out ratio"] + POLICIES + ["skip-join / best", "target <= 1.10"], rows))
    out.append("\n## Skip-join's gap: other policy's mean normalized latency / skip-join's "
               "(paper: mlfq up to 1.87x, fixed-priority up to 13.9x)\n")
    out.append(md_table(["in:out ratio", "mlfq / skip-join", "per seed", "fixed-priority / skip-join", "per seed",
                         "fcfs / skip-join"], gap_rows))
    out.append("\n## Workload at each ratio (seed 0) and what skip-join sees (q1 = "
               f"{COST.min_iteration_seconds() * 1e3:.1f} ms)\n")
    out.append(md_table(["in:out ratio", "prompt mean", "output mean", "prompt max", "fcfs sat req/s",
                         "prefill mean ms", "prefill max ms", "prefill > q1", "skip-join entry queue mean",
                         "entry max", "prompt > 2048 (chunked)", "prefill share of work",
                         "jobs in system fcfs", "jobs in system skip-join", "wall s"], diag_rows))
    out.append("\n## Per policy (seed mean, (seed 0, seed 1))\n")
    out.append(md_table(["ratio", "policy", "mean norm s/tok", "p95 norm s/tok", "mean TTFT s", "p99 TTFT s",
                         "p99.9 TBT ms", "preemptions", "tput req/s"], detail_rows))
    return "\n".join(out)


# ---------------------------------------------------------------- mechanism diagnostic

DIAG_RATIOS = [0.25, 4, 16, 64, 256]


def prefill_stalls(ratio: float, policy: str, seed: int, n: int, rate: float) -> dict[str, Any]:
    """Replay one run with the executor wrapped (tokenslice untouched) and measure what prefill work
    costs the requests decoding beside it: for every step with a prefill chunk, each co-batched
    decode waits (step time - the same decodes' step alone). Decode-only steps are skipped in bulk
    by the simulator and never reach execute(); they have no prefill, so nothing is missed."""
    from tokenslice.sim.simulate import ample_kv_blocks
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.sim.replay import replay
    from tokenslice.predict.cost import BatchShape

    spec = make_spec("sharegpt", policies=[policy], rates=[rate], io_ratio=ratio, seeds=[seed], num_requests=n)
    wl = spec.make(seed, rate, CACHE)
    slo = 10 * COST.min_iteration_seconds()
    engine = simulated_engine(spec.scheduler_config(policy, slo), COST,
                              kv_cache_blocks=ample_kv_blocks(spec.make(seed, None, CACHE), 16))
    ex = engine.executor
    inner = ex.execute
    acc = {"prefill_steps": 0, "prefill_tokens": 0, "prefill_step_s": 0.0, "decodes_beside_prefill": 0,
           "stall_decode_s": 0.0, "long_steps": 0, "long_step_decodes": 0, "max_step_s": 0.0,
           "excluded_decoders": 0, "excluded_decode_s": 0.0}
    live = engine.scheduler.requests
    q1 = COST.min_iteration_seconds()

    def execute(plan):  # noqa: ANN001, ANN202
        result = inner(plan)
        if plan.prefill:
            dec = [sl.start_pos + 1 for sl in plan.decode]
            alone = COST.iteration_seconds(BatchShape.from_lengths(decode=dec)) if dec else 0.0
            acc["prefill_steps"] += 1
            acc["prefill_tokens"] += sum(sl.num_tokens for sl in plan.prefill)
            acc["prefill_step_s"] += result.step_seconds
            acc["decodes_beside_prefill"] += len(dec)
            acc["stall_decode_s"] += len(dec) * (result.step_seconds - alone)
            # Requests past their prefill that are not in this step at all (batch full or token
            # budget spent on prefill): they wait the whole step.
            batch = {sl.request_id for sl in plan.prefill} | {sl.request_id for sl in plan.decode}
            out = sum(1 for r in live.values() if r.request_id not in batch and not r.is_finished
                      and r.num_computed_tokens >= r.num_prompt_tokens)
            acc["excluded_decoders"] += out
            acc["excluded_decode_s"] += out * result.step_seconds
            if result.step_seconds > 4 * q1:
                acc["long_steps"] += 1
                acc["long_step_decodes"] += len(dec)
            acc["max_step_s"] = max(acc["max_step_s"], result.step_seconds)
        return result

    ex.execute = execute
    reqs = replay(engine, list(wl))
    out_tokens = sum(r.num_output_tokens for r in reqs)
    # Cross-check against the sweep's run of the same (ratio, policy, seed): must be identical.
    acc["mean_normalized_latency"] = float(np.mean([(r.metrics.finish_time - r.metrics.arrival_time)
                                                    / max(r.num_output_tokens, 1) for r in reqs]))
    acc.update(output_tokens=out_tokens, num_steps=engine.num_steps, makespan_s=engine.clock.now(),
               stall_per_output_token_ms=1e3 * acc["stall_decode_s"] / max(out_tokens, 1),
               decode_wait_per_output_token_ms=1e3 * (acc["stall_decode_s"] + acc["excluded_decode_s"])
               / max(out_tokens, 1),
               decodes_per_prefill_step=acc["decodes_beside_prefill"] / max(acc["prefill_steps"], 1),
               demotions=getattr(engine.scheduler.policy, "num_demotions", None),
               promotions=getattr(engine.scheduler.policy, "num_promotions", None))
    return acc


def diagnose(all_res: Mapping[str, Mapping[str, Any]], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ratio in DIAG_RATIOS:
        res = all_res[f"{ratio:g}"]
        rate = next(r["rate"] for r in res["runs"] if r["seed"] == 0)
        for p in POLICIES:
            t = time.perf_counter()
            out[f"{ratio:g}/{p}"] = d = prefill_stalls(ratio, p, 0, n, rate)
            swept = next(r["metrics"]["mean_normalized_latency"] for r in res["runs"]
                         if r["seed"] == 0 and r["policy"] == p)
            d["matches_sweep"] = abs(d["mean_normalized_latency"] - swept) <= 1e-9 * max(swept, 1e-12)
            log(f"  diagnose R={ratio:g} {p}: {d['stall_per_output_token_ms']:.2f} ms stall/token, "
                f"{time.perf_counter() - t:.1f} s wall")
    return out


def diagnose_table(diag: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for key, d in diag.items():
        ratio, p = key.split("/")
        rows.append([ratio, p, d["prefill_steps"], fmt(d["prefill_tokens"] / max(d["prefill_steps"], 1), 4),
                     fmt(d["decodes_per_prefill_step"], 3), d["long_steps"], fmt(d["max_step_s"] * 1e3, 4),
                     fmt(d["stall_decode_s"], 4), fmt(d["excluded_decode_s"], 4),
                     fmt(d["decode_wait_per_output_token_ms"], 3),
                     "-" if d["demotions"] is None else d["demotions"],
                     "-" if d["promotions"] is None else d["promotions"]])
    return md_table(["ratio", "policy", "steps with prefill", "prefill tokens / such step",
                     "decodes beside a prefill", "steps > 4 q1", "longest step ms",
                     "decode-s stalled beside a prefill", "decode-s shut out of prefill steps",
                     "both per output token ms", "demotions",
                     "starvation promotions"], rows)


def plot(all_res: Mapping[str, Mapping[str, Any]], n: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [res["benchmark"]["io_ratio"] for res in all_res.values()]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.0))
    width = 0.8 / len(POLICIES)
    for ax, metric, label in ((axes[0], "mean_normalized_latency", "normalized latency (/ slowest at each ratio)"),
                              (axes[1], "mean_ttft", "mean TTFT (/ slowest at each ratio)")):
        for k, p in enumerate(POLICIES):
            ys = []
            for res in all_res.values():
                vals = {q: v[0] for q, v in per_policy(res, metric).items()}
                ys.append(vals[p] / max(vals.values()))
            ax.bar(np.arange(len(ratios)) + (k - (len(POLICIES) - 1) / 2) * width, ys, width, label=p, color=f"C{k}")
        ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
        ax.set_xlabel("mean input : output length ratio")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        if metric == "mean_ttft":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=4)
    axes[1].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=4)
    fig.suptitle(f"cf. FastServe Fig. 14: ShareGPT rescaled, Poisson at rho={LOAD} of fcfs saturation per ratio, "
                 f"N={n}, seeds 0,1 ({PROFILE}, batch 16)", fontsize=9)
    return save_figure(fig, "sched_io_ratio_fig14.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=N)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="also replay seed 0 with an instrumented executor "
                    "(prefill stalls of co-batched decodes, demotions) at ratios " + ", ".join(map(str, DIAG_RATIOS)))
    a = ap.parse_args()
    name = f"sched_io_ratio_n{a.num_requests}.json"
    if a.report_only:
        all_res = read_json(name)
    else:
        all_res = {f"{r:g}": simulate(r, a.num_requests) for r in RATIOS}
        write_json(name, all_res)
    first = next(iter(all_res.values()))
    print(f"# Input:output ratio sweep (FastServe Fig. 14), N = {a.num_requests}, Poisson, rho = {LOAD} of fcfs "
          f"saturation at each ratio, seeds {SEEDS}; code {first['benchmark']['code']['head']}\n")
    print("command per ratio R: " + first["benchmark"]["command"].replace("--io-ratio 0.25", "--io-ratio R") + "\n")
    print(tables(all_res))
    diag_name = f"sched_io_ratio_diagnose_n{a.num_requests}.json"
    if a.diagnose:
        write_json(diag_name, diagnose(all_res, a.num_requests))
    try:
        diag = read_json(diag_name)
    except FileNotFoundError:
        diag = None
    if diag:
        print("\n## Mechanism (seed 0): what prefill chunks cost the decodes batched beside them\n")
        print(diagnose_table(diag))
    log(f"wrote {plot(all_res, a.num_requests)}")


if __name__ == "__main__":
    main()
