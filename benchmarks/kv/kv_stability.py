"""KV memory: stability under memory pressure (simulated).

Profile opt-13b@a100-40gb, ShareGPT, batch 16, device KV 14,000 tokens (what an A100-40GB leaves
next to OPT-13B), host 4x that; skip-join-mlfq with starvation promotion on, in every preemption
mode, Gamma CV = 4 and Poisson at rho = 0.6, 0.8, 0.95 of fcfs saturation (measured with ample
KV), 2 seeds. Each cell's mean normalized latency is compared with the same policy and arrival
stream with ample KV memory (target: within 1.5x).

An ablation runs recompute and reactive-swap with the anti-thrashing protection off
(--eviction-amortization 0) to show the collapse it prevents.

    nice -n 19 .venv/bin/python benchmarks/kv/kv_stability.py [--num-requests 2000] [--jobs 2]
    .venv/bin/python benchmarks/kv/kv_stability.py --report-only

Results: benchmarks/kv/results/kv_stability_n{N}.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tokenslice.sim.simulate import ample_kv_blocks, fcfs_saturation_rps, run_metrics, simulate_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import (  # noqa: E402
    CACHE, COST, PROFILE, code_version, fmt, log, machine_line, make_spec, md_table, read_json,
    write_json)

POLICY = "skip-join-mlfq"
MODES = ["defer", "recompute", "reactive-swap", "proactive-swap"]
ABLATION = ["recompute", "reactive-swap"]  # with eviction_amortization = 0
DEVICE_TOKENS = 14_000
BLOCK = 16
DEVICE_BLOCKS = DEVICE_TOKENS // BLOCK
HOST_BLOCKS = 4 * DEVICE_BLOCKS
LOADS = [0.6, 0.8, 0.95]
CVS = [1.0, 4.0]
SEEDS = [0, 1]
BOUND = 1.5
KEEP = ("mean_normalized_latency", "p95_normalized_latency", "mean_ttft", "p99_ttft", "preemptions",
        "recomputed_tokens", "swap_out_bytes", "swap_in_bytes", "swap_ops", "swap_stall_s", "queue_s", "exec_s",
        "mean_jct", "host_peak_blocks", "swap_fallbacks", "kv_peak_blocks")


def one_cell(cv: float, load: float, seed: int, n: int) -> list[dict[str, Any]]:
    """Ample reference, the four modes and the ablation on one arrival stream."""
    spec = make_spec("sharegpt", policies=[POLICY], loads=[load], cv=cv, num_requests=n)
    slo = 10 * COST.min_iteration_seconds()
    at_once = spec.make(seed, None, CACHE)
    ample = ample_kv_blocks(at_once, spec.max_batch_size, BLOCK)
    sat = fcfs_saturation_rps(COST, at_once, spec.scheduler_config("fcfs", slo), ample, BLOCK)
    wl = spec.make(seed, load * sat, CACHE)
    out = []
    variants = [("ample", "recompute", ample, None)] + [(m, m, DEVICE_BLOCKS, None) for m in MODES]
    variants += [(f"{m} (no protection)", m, DEVICE_BLOCKS, 0.0) for m in ABLATION]
    for name, mode, blocks, amortization in variants:
        cfg = dataclasses.replace(spec.scheduler_config(POLICY, slo), preemption=mode)
        if amortization is not None:
            cfg = dataclasses.replace(cfg, eviction_amortization=amortization)
        t0 = time.perf_counter()
        records, counters = simulate_run(COST, wl, cfg, blocks, BLOCK, HOST_BLOCKS)
        m = run_metrics(records, counters, slo)
        out.append({"variant": name, "preemption": mode, "cv": cv, "load": load, "seed": seed, "rate": load * sat,
                    "kv_cache_blocks": blocks, "wall_s": time.perf_counter() - t0,
                    "metrics": {k: m.get(k) for k in KEEP}})
    log(f"cv={cv:g} rho={load:g} seed={seed} done")
    return out


def report(data: dict[str, Any]) -> None:
    runs = data["runs"]
    print(f"# KV stability: {PROFILE}, ShareGPT, batch 16, device {DEVICE_TOKENS} tokens, host 4x, "
          f"N={data['num_requests']}, seeds {SEEDS}")
    variants = ["ample"] + MODES + [f"{m} (no protection)" for m in ABLATION]
    rows = []
    worst: dict[str, float] = {}
    for cv in CVS:
        for load in LOADS:
            def mean(variant: str, key: str = "mean_normalized_latency") -> float:
                xs = [r["metrics"][key] for r in runs if r["variant"] == variant and r["cv"] == cv
                      and r["load"] == load]
                return sum(xs) / len(xs) if xs else float("nan")

            ref = mean("ample")
            row: list[Any] = [f"{'Poisson' if cv == 1 else f'CV={cv:g}'} rho={load:g}", fmt(ref)]
            for v in variants[1:]:
                ratio = mean(v) / ref
                worst[v] = max(worst.get(v, 0.0), ratio)
                swap_s = mean(v, "swap_stall_s") / data["num_requests"]  # per request
                stall = swap_s / max(swap_s + mean(v, "queue_s") + mean(v, "exec_s"), 1e-12)
                row.append(f"{fmt(mean(v))} ({ratio:.2f}x{', stall ' + format(stall, '.1%') if 'swap' in v and 'no' not in v else ''})")
            rows.append(row)
    print(md_table(["cell", "ample"] + variants[1:], rows))
    print()
    print(md_table(["mode", "worst ratio to ample", f"<= {BOUND}x"],
                   [[v, f"{worst[v]:.2f}x", "PASS" if worst[v] <= BOUND else "MISS"] for v in variants[1:]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    name = f"kv_stability_n{a.num_requests}.json"
    if not a.report_only:
        cells = [(cv, load, seed) for cv in CVS for load in LOADS for seed in SEEDS]
        t0 = time.perf_counter()
        with ProcessPoolExecutor(a.jobs) as pool:
            parts = list(pool.map(one_cell, *zip(*cells), [a.num_requests] * len(cells)))
        write_json(name, {"num_requests": a.num_requests, "profile": PROFILE, "machine": machine_line(),
                          "code": code_version(), "wall_s": time.perf_counter() - t0,
                          "runs": [r for p in parts for r in p]})
    report(read_json(name))


if __name__ == "__main__":
    main()
