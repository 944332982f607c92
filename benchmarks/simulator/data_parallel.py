"""Data-parallel routing on the simulator (tokenslice/sim/replicas.py): the API server's Router over
16 simulated engines, at paper scale.

Setup (fixed before any run): OPT-13B@A100-40GB (the simulator's profile of record), fcfs in each
engine, batch 16, the CLI's ample KV pool; held-out-style ShareGPT (shared sched_common datasets,
GPT-2 token counts, vLLM's length filter), N = 1,600 requests (100 per replica), seed 0, Gamma
CV 4 arrivals at 0.8 and 0.9 of the replicas' capacity (16 x one engine's fcfs saturation on
N / 16 of the requests). Routers: round-robin, least-work, prefix-aware; the router knows each
replica's batch size. (This workload's only shared prefixes are repeated prompts: 1,600 drawn
from the filtered pool with replacement.)

Multi-turn (the prefix target): ShareGPT conversations with 2 or more turns (GPT-2 token ids of
each turn), turn k's prompt = every earlier turn's question and answer + its own question (the
answers as the placeholder tokens the simulator generates, so a turn's prefix is exactly what its
previous turn left in a replica's prefix cache), capped at 2,048 tokens of prompt; first turns
arrive Gamma CV 4 at 0.8 of capacity, each next turn a think time (exponential, mean 20 s) after
the previous turn's arrival; N = 1,600 turns. Reported: the share of prompt tokens served from a
prefix cache, round-robin against prefix-aware (target >= 2x).

Reported: mean and p99 TTFT, mean normalized latency, throughput, and the prefix-cache hit share.
Targets (issue): least-work (+ migration, not built) p99 TTFT >= 2x and mean >= 1.3x better than
round-robin at equal throughput; prefix-aware >= 2x round-robin's prefix-cache hits.

    PYTHONPATH=. .venv/bin/python benchmarks/simulator/data_parallel.py

Results: benchmarks/simulator/results/data_parallel.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import CACHE, COST, DATASETS, PROFILE, code_version, fmt, log, md_table, \
    write_json  # noqa: E402

from tokenslice.bench.metrics import summarize  # noqa: E402
from tokenslice.bench.workloads import make_workload  # noqa: E402
from tokenslice.config import SchedulerConfig  # noqa: E402
from tokenslice.engine.router import Router  # noqa: E402
from tokenslice.sim.engine import simulated_engine  # noqa: E402
from tokenslice.sim.replicas import ReplicaSet  # noqa: E402
from tokenslice.sim.simulate import ample_kv_blocks, fcfs_saturation_rps, records_from_requests  # noqa: E402

NAME = "data_parallel.json"
REPLICAS = 16
PER_REPLICA = 100
BATCH = 16
LOADS = [0.8, 0.9]
CV = 4.0
ROUTERS = ["round-robin", "least-work", "prefix-aware"]
METRICS = [("mean TTFT s", "mean_ttft", 1.0), ("p99 TTFT s", "p99_ttft", 1.0),
           ("mean norm s/tok", "mean_normalized_latency", 1.0), ("req/s", "throughput_rps", 1.0)]


def config() -> SchedulerConfig:
    return SchedulerConfig(policy="fcfs", max_batch_size=BATCH)


def run(workload: list[Any], router: str, blocks: int) -> dict[str, Any]:
    engines = [simulated_engine(config(), COST, kv_cache_blocks=blocks) for _ in range(REPLICAS)]
    reqs, placed = ReplicaSet(engines, Router(router, REPLICAS, slots=BATCH)).replay(workload)
    metrics = summarize(records_from_requests(reqs))
    queries = sum(e.scheduler.stats.prefix_cache_queries for e in engines)
    hits = sum(e.scheduler.stats.prefix_cache_device_hits + e.scheduler.stats.prefix_cache_host_hits for e in engines)
    for e in engines:
        e.close()
    return {"router": router, "metrics": metrics, "per_replica": [placed.count(i) for i in range(REPLICAS)],
            "prefix_hit_share": hits / queries if queries else 0.0}


def measure(kind: str, n: int) -> dict[str, Any]:
    base = make_workload(kind, num_requests=n, seed=0, cache=CACHE, **DATASETS["sharegpt"])
    blocks = ample_kv_blocks(base, BATCH)
    one = fcfs_saturation_rps(COST, base[: n // REPLICAS], config(), blocks)
    capacity = REPLICAS * one
    log(f"{kind}: one engine's fcfs saturation {one:.3f} req/s, capacity {capacity:.2f} req/s")
    out: dict[str, Any] = {"capacity_rps": capacity, "points": []}
    loads = LOADS if kind == "sharegpt" else [0.8]
    routers = ROUTERS if kind == "sharegpt" else ["round-robin", "prefix-aware"]
    for load in loads:
        workload = make_workload(kind, num_requests=n, rate=load * capacity, cv=CV, seed=0, cache=CACHE,
                                 **DATASETS["sharegpt"])
        for router in routers:
            t = time.perf_counter()
            res = run(workload, router, blocks)
            log(f"{kind} load {load} {router}: {time.perf_counter() - t:.1f} s")
            out["points"].append({"load": load, **res})
    return out


MAX_TURN_PROMPT = 2048
THINK_S = 20.0


def multiturn_workload(n: int, rate: float, seed: int = 0) -> list[Any]:
    """Turns of ShareGPT conversations, each prompt holding its conversation so far (docstring)."""
    import numpy as np

    from tokenslice.bench.arrivals import arrival_times
    from tokenslice.bench.datasets import resolve_dataset
    from tokenslice.bench.workloads import WorkloadRequest

    convs = [c for c in CACHE.conversation_records(resolve_dataset("sharegpt", DATASETS["sharegpt"]["dataset"]),
                                                   DATASETS["sharegpt"]["tokenizer"]) if len(c) >= 2]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(convs))
    turns = sum(len(c) for c in convs) / len(convs)
    starts = iter(arrival_times(len(convs), rate / turns, CV, rng))  # turns arrive at about `rate`
    out: list[WorkloadRequest] = []
    for ci in order:
        t = float(next(starts))
        history: list[int] = []
        for rec in convs[ci]:
            prompt = (history + list(rec.prompt_token_ids))[-MAX_TURN_PROMPT:]
            out_len = max(1, min(rec.output_len, 1024))
            out.append(WorkloadRequest(f"{rec.conversation_id}-{rec.turn}", t, None, len(prompt), out_len,
                                       conversation_id=str(rec.conversation_id), turn=rec.turn,
                                       prompt_token_ids=prompt))
            history = prompt + [0] * out_len  # the simulator's generated tokens are placeholders (0)
            t += float(rng.exponential(THINK_S))
            if len(out) >= n:
                return sorted(out, key=lambda r: r.arrival_time)
    return sorted(out, key=lambda r: r.arrival_time)


def measure_multiturn(n: int, capacity: float) -> dict[str, Any]:
    work = multiturn_workload(n, 0.8 * capacity)
    blocks = ample_kv_blocks(work, BATCH)
    out: dict[str, Any] = {"capacity_rps": capacity, "points": []}
    for router in ("round-robin", "prefix-aware", "least-work"):
        t = time.perf_counter()
        res = run(work, router, blocks)
        log(f"multiturn {router}: {time.perf_counter() - t:.1f} s, prefix hits {res['prefix_hit_share']:.3f}")
        out["points"].append({"load": 0.8, **res})
    return out


def report(out: dict[str, Any]) -> None:
    for kind in ("sharegpt", "multiturn"):
        if kind not in out:
            continue
        part = out[kind]
        rows = []
        base = {p["load"]: p["metrics"] for p in part["points"] if p["router"] == "round-robin"}
        for p in part["points"]:
            cells: list[Any] = [f"{p['load']:g}", p["router"]]
            for _, key, scale in METRICS:
                v = p["metrics"].get(key)
                b = base[p["load"]].get(key)
                ratio = f" ({b / v:.2f}x better)" if key != "throughput_rps" and v and b and p["router"] != "round-robin" else ""
                cells.append(fmt(v * scale if v is not None else None, 3) + ratio)
            cells.append(f"{100 * p['prefix_hit_share']:.1f}%")
            cells.append(f"{min(p['per_replica'])}-{max(p['per_replica'])}")
            rows.append(cells)
        print(f"\n## {kind}, {REPLICAS} replicas of {PROFILE}, fcfs, batch {BATCH}, CV {CV:g} "
              f"(capacity {part['capacity_rps']:.2f} req/s)\n")
        print(md_table(["load", "router"] + [c for c, _, _ in METRICS] + ["prefix hits", "requests/replica"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if a.report_only:
        from sched_common import read_json

        report(read_json(NAME))
        return
    n = REPLICAS * PER_REPLICA
    out: dict[str, Any] = {"code": code_version(), "date": time.strftime("%Y-%m-%d"), "n": n}
    out["sharegpt"] = measure("sharegpt", n)
    write_json(NAME, out)
    out["multiturn"] = measure_multiturn(n, out["sharegpt"]["capacity_rps"])
    write_json(NAME, out)
    report(out)


if __name__ == "__main__":
    main()
