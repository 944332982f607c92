"""The stall guard under memory pressure on the simulator (docs/DESIGN.md, "Stall guard"): how
long `tokenslice simulate` takes, and what it reports, with the guard off and on, on a tight and
an ample KV pool.

Setup, the CLI's: OPT-13B@A100-40GB, held-out ShareGPT (shared sched_common datasets),
skip-join-mlfq with proactive-swap, batch 16, Gamma CV 4 arrivals at load 0.8 of fcfs's
saturation (measured on the same pool and guard, as the CLI does), seed 0. Tight: 875 device
and 3,500 host KV blocks; ample: the CLI's default pool (every request fits at once).

Wall time is run_sweep's (the saturation run and the measured run) with the dataset already
tokenized; the best of `--repeats`, cells interleaved, since the box is shared. Targets: tight
with the guard on within 1.5x of the guard off's wall time, and its mean normalized latency
within 1.5x of the ample pool's with the guard on.

    PYTHONPATH=. .venv/bin/python benchmarks/simulator/stall_guard_memory.py [--num-requests 2000] [--repeats 3]

Results: benchmarks/simulator/results/stall_guard_memory_n{N}.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import CACHE, CLI_DATASET, COST, DATASETS, PROFILE, code_version, fmt, log, md_table, \
    write_json  # noqa: E402

from tokenslice.sim.simulate import SweepSpec, run_sweep, strip_per_request  # noqa: E402

POLICY = "skip-join-mlfq"
MEMORY: dict[str, dict[str, Any]] = {
    "tight": {"kv_cache_blocks": 875, "host_kv_blocks": 3500},
    "ample": {"kv_cache_blocks": None, "host_kv_blocks": None},
}
GUARDS = ("off", "on")
# (column, metric key, scale): what `tokenslice simulate` prints, in the units it prints them.
METRICS = [("mean norm s/tok", "mean_normalized_latency", 1.0), ("mean TTFT s", "mean_ttft", 1.0),
           ("p99 TTFT s", "p99_ttft", 1.0), ("p99 TBT ms", "p99_tbt", 1e3), ("p99.9 TBT ms", "p999_tbt", 1e3),
           ("stall s", "stall_s", 1.0), ("preempt", "preemptions", 1.0), ("swap ops", "swap_ops", 1.0)]


def spec(memory: str, guard: str, n: int) -> SweepSpec:
    return SweepSpec(workload="sharegpt", policies=[POLICY], preemption="proactive-swap", loads=[0.8], cv=4.0,
                     seeds=[0], num_requests=n, stall_guard=guard, **DATASETS["sharegpt"], **MEMORY[memory])


def timed(memory: str, guard: str, n: int) -> tuple[float, dict[str, Any]]:
    """run_sweep's wall seconds and its one run's metrics (plus the step count)."""
    t = time.perf_counter()
    res = strip_per_request(run_sweep(COST, spec(memory, guard, n), cache=CACHE))
    return time.perf_counter() - t, res["runs"][0]["metrics"]


def command(memory: str, guard: str, n: int) -> str:
    mem = "" if memory == "ample" else " --kv-cache-blocks 875 --host-kv-blocks 3500"
    return (f".venv/bin/tokenslice simulate --profile {PROFILE} {CLI_DATASET['sharegpt']} --policy {POLICY} "
            f"--loads 0.8 --cv 4 --num-requests {n}{mem} --preemption proactive-swap --stall-guard {guard}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3, help="timings per cell; the best counts (default: 3)")
    args = ap.parse_args()
    n = args.num_requests
    spec("ample", "off", n).make(0, None, CACHE)  # tokenize once: no cell pays for it
    cells = [(m, g) for m in MEMORY for g in GUARDS]
    walls: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    metrics: dict[tuple[str, str], dict[str, Any]] = {}
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for memory, guard in cells:
            wall, m = timed(memory, guard, n)
            walls[memory, guard].append(wall)
            metrics[memory, guard] = m  # the simulator is deterministic: every repeat reports the same
            log(f"repeat {rep + 1}/{args.repeats} {memory} guard {guard}: {wall:.1f} s")
    best = {c: min(w) for c, w in walls.items()}
    rows = [[memory, guard, f"{best[memory, guard]:.1f}", metrics[memory, guard]["num_steps"]]
            + [fmt(metrics[memory, guard][k] * scale) for _, k, scale in METRICS] for memory, guard in cells]
    print(md_table(["memory", "guard", "wall s", "steps"] + [c for c, _, _ in METRICS], rows))
    wall_ratio = best["tight", "on"] / best["tight", "off"]
    lat_ratio = metrics["tight", "on"]["mean_normalized_latency"] / metrics["ample", "on"]["mean_normalized_latency"]
    print(f"\ntight, guard on / off wall time: {wall_ratio:.2f}x (target <= 1.5x)")
    print(f"tight / ample mean normalized latency, guard on: {lat_ratio:.2f}x (target <= 1.5x)")
    write_json(f"stall_guard_memory_n{n}.json", {
        "num_requests": n, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"), "code": code_version(),
        "commands": {f"{m}/{g}": command(m, g, n) for m, g in cells},
        "cells": [{"memory": m, "guard": g, "wall_s": walls[m, g], "best_wall_s": best[m, g], "metrics": metrics[m, g]}
                  for m, g in cells],
        "tight_on_off_wall_ratio": wall_ratio, "tight_ample_latency_ratio": lat_ratio,
        "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
