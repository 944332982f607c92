"""The stall guard on the simulator (docs/DESIGN.md, "Stall guard"): FastServe's single-GPU
setting with and without the guard, for each policy.

Protocol, fixed before any run:

- Cost model opt-13b@a100-40gb (FastServe's single-GPU setting); device KV pool: what is left
  beside the weights (`kv_capacity_tokens()`), 16-token blocks, host tier 4x; batch 16; datasets,
  lengths, held-out records and the srpt-predicted predictor exactly as fastserve_fig11b.py.
- Policies with their papers' memory modes: fcfs (recompute, vLLM), skip-join-mlfq and
  srpt-predicted (proactive-swap).
- Steady-state cells (docs/DESIGN.md, cut to fit the time: N = 1,000, seed 0): ShareGPT and
  Alpaca, Poisson (CV 1) and Gamma CV 4 arrivals, at rho = 0.9 of fcfs's saturation (every
  request at t = 0, measured at that N).
- Guard variants: off; `on` (each started stream's reader takes 10 tokens/s: protected when
  about to run dry); `on` + `--max-stall-ms 250` (a hard bound on the gap between two tokens of a
  started stream, on top).
- Reported per cell, policy and variant: mean TTFT, mean normalized latency, p99.9 TBT, total
  reader stall (10 tokens/s), Andes' mean QoE, preemptions of started streams.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/stall_guard_sim.py
    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/stall_guard_sim.py --report-only

Results: benchmarks/scheduling/results/stall_guard_sim_n1000.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from fastserve_fig11b import SEED, VARIANTS, runner  # noqa: E402
from sched_common import Runner, code_version, fmt, log, md_table, read_json, write_json  # noqa: E402
from sched_predicted import prepare  # noqa: E402

PROFILE = "opt-13b@a100-40gb"
DATASETS = ("sharegpt", "alpaca")
CELLS = [(1.0, 0.9), (4.0, 0.9)]  # (cv, rho)
GUARDS: dict[str, dict[str, Any]] = {
    "off": {"stall_guard": "off", "max_stall_ms": None},
    "on": {"stall_guard": "on", "max_stall_ms": None},
    "on+250ms": {"stall_guard": "on", "max_stall_ms": 250.0},
}
METRICS = [("mean TTFT s", "mean_ttft", 1.0), ("mean norm s/tok", "mean_normalized_latency", 1.0),
           ("p99.9 TBT ms", "p999_tbt", 1e3), ("stall s", "stall_s", 1.0), ("QoE", "mean_qoe", 1.0),
           ("started preempt", "started_preemptions", 1.0)]


def file_name(n: int) -> str:
    return f"stall_guard_sim_n{n}.json"


def guarded(r: Runner, guard: str) -> Runner:
    """The same runner (workloads, KV pool) with the guard variant's scheduler settings."""
    spec = dataclasses.replace(r.spec, **GUARDS[guard])
    return Runner(spec, r.cost)


def saturation(dataset: str, n: int) -> float:
    return runner(dataset, "fcfs", "recompute", n, PROFILE).saturation(SEED)


def cell_run(dataset: str, n: int, policy: str, preemption: str, cv: float, rho: float, guard: str,
             sat: float) -> dict[str, Any]:
    r = guarded(runner(dataset, policy, preemption, n, PROFILE, cv), guard)
    r.set_saturation(SEED, sat)
    run = dict(r.run(policy, rho * sat, SEED))
    run.pop("tbt_cdf", None)
    run.update(dataset=dataset, guard=guard, load=rho, saturation_rps=sat)
    return run


def run_all(n: int, jobs: int, cells: list[tuple[float, float]]) -> list[dict[str, Any]]:
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        sats = {d: pool.submit(saturation, d, n) for d in DATASETS}
        futures = [pool.submit(cell_run, d, n, policy, pre, cv, rho, guard, sats[d].result())
                   for d in DATASETS for cv, rho in cells for policy, pre in VARIANTS for guard in GUARDS]
        return [f.result() for f in futures]


def table(runs: list[dict[str, Any]], cells: list[tuple[float, float]]) -> str:
    rows = []
    for d in DATASETS:
        for cv, rho in cells:
            cell = [r for r in runs if r["dataset"] == d and r["cv"] == cv and r["load"] == rho]
            base = next(r["metrics"] for r in cell if r["policy"] == "fcfs" and r["guard"] == "off")
            for policy, _ in VARIANTS:
                for guard in GUARDS:
                    m = next(r["metrics"] for r in cell if r["policy"] == policy and r["guard"] == guard)
                    row: list[Any] = [d, "Poisson" if cv == 1.0 else f"CV {cv:g}", policy, guard]
                    for _, key, scale in METRICS:
                        v, b = m.get(key), base.get(key)
                        ratio = f" ({v / b:.2f}x)" if key in ("mean_ttft", "mean_normalized_latency", "p999_tbt") \
                            and v is not None and b and policy != "fcfs" else ""
                        row.append(fmt(v * scale if v is not None else None, 3) + ratio)
                    rows.append(row)
    return md_table(["dataset", "arrivals", "policy", "guard"] + [c for c, _, _ in METRICS], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cvs", default="1,4", help="arrival CVs of the cells to run (rho 0.9 each)")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    cells = [(cv, rho) for cv, rho in CELLS if f"{cv:g}" in a.cvs.split(",")]
    name = file_name(a.num_requests) if len(cells) == len(CELLS) else file_name(a.num_requests).replace(
        ".json", "_cv" + "_".join(f"{cv:g}" for cv, _ in cells) + ".json")
    if a.report_only:
        out = read_json(name)
    else:
        t0 = time.perf_counter()
        data = prepare()
        runs = run_all(a.num_requests, max(1, a.jobs), cells)
        out = {"profile": PROFILE, "runs": runs, "held_out": data, "guards": GUARDS, "cells": cells,
               "code": code_version(), "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - t0}
        write_json(name, out)
        log(f"wrote results/{name} in {out['wall_s']:.0f} s")
    print(f"## Stall guard on the simulator: {out['profile']}, rho 0.9, N = {a.num_requests}, seed {SEED}\n")
    print(table(out["runs"], [tuple(c) for c in out["cells"]]))


if __name__ == "__main__":
    main()
