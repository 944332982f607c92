"""Real engine, same scheduler code (scheduling benchmarks, parts 5 and 7).

On this CPU with ../shared/models/stories260k and an Alpaca-shaped workload (GPT-2 token counts,
vLLM's length filter, prompt + output capped to the model's 512-token context), Gamma CV = 4
arrivals at rho = 0.8 of the real engine's own fcfs saturation throughput:
  * item 5: mean normalized latency and mean TTFT of each policy, measured in one run;
  * item 7: after `tokenslice profile` on this machine, the simulator replays the same trace with
    the fitted profile; the error of its mean normalized latency and mean TTFT per policy.

    .venv/bin/python benchmarks/scheduling/real_engine_sched.py [--num-requests 600] [--out results.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from tokenslice.bench.metrics import summarize
from tokenslice.sim.simulate import records_from_requests
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.workloads import make_workload
from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.sim.profile_options import ProfileOptions
from tokenslice.sim.profiler import run_profile
from tokenslice.predict.cost import load_cost_model

SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = SHARED / "models" / "stories260k"
POLICIES = ["fcfs", "skip-join-mlfq", "srpt-oracle"]
BATCH = 16
CONTEXT = 512  # stories260k's context: no request is longer


def workload(n: int, rate: float | None, cv: float, seed: int) -> list:
    reqs = make_workload("alpaca", num_requests=n, rate=rate, cv=cv, seed=seed,
                         dataset=SHARED / "data" / "alpaca_4500.json", tokenizer=SHARED / "tokenizers" / "gpt2",
                         length_filter=True, max_prompt_len=256, max_tokens_cap=255, cache=CACHE)
    # Prompts as token ids of the stated length (any ids: outputs run to their length with ignore_eos).
    return [dataclasses.replace(r, prompt=None, prompt_token_ids=[1] + [100 + (i % 300) for i in range(r.prompt_len - 1)])
            for r in reqs]


CACHE = DatasetCache()


def ample_blocks(n: int) -> int:
    """Room for every request of the trace at once: memory never binds in this experiment (the
    KV-memory benchmarks study what happens when it does)."""
    return n * CONTEXT // 16


def real_engine(policy: str, profile: str | None, blocks: int, **scheduler_changes: Any) -> Engine:
    cfg = EngineConfig(model=ModelConfig(model=str(MODEL), dtype="float32"),
                       cache=CacheConfig(kv_cache_blocks=blocks),
                       scheduler=SchedulerConfig(policy=policy, max_batch_size=BATCH, **scheduler_changes),
                       profile=profile)
    return Engine.from_config(cfg)


def run(engine: Engine, trace: list) -> dict:
    reqs = replay(engine, trace)
    m = summarize(records_from_requests(reqs))
    m["steps"] = engine.num_steps
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--cv", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is as fast for this tiny model and immune to a busy neighbour "
                         "(two OpenMP threads on a shared 2-core box stall at every barrier)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    report = run_profile(ProfileOptions(model=str(MODEL), dtype="float32", max_batch_size=BATCH, max_context=512))
    profile_path = Path(args.out or "benchmarks/scheduling/results/real_engine_sched.json").with_suffix(".profile.json")
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    report.cost.save(profile_path)
    print(f"profile: fitted in {time.perf_counter() - t0:.0f} s, r2 = {report.cost.r2:.3f} -> {profile_path}")

    # Saturation: every request at t = 0 under fcfs, on the real engine.
    burst = workload(args.num_requests, None, 1.0, args.seed)
    blocks = ample_blocks(args.num_requests)
    eng = real_engine("fcfs", str(profile_path), blocks)
    t = time.perf_counter()
    replay(eng, burst)
    sat = len(burst) / (time.perf_counter() - t)
    rate = args.load * sat
    print(f"real fcfs saturation: {sat:.1f} req/s; running at rho = {args.load} -> {rate:.1f} req/s, CV = {args.cv}")

    trace = workload(args.num_requests, rate, args.cv, args.seed)
    cost = load_cost_model(str(profile_path))
    rows = []
    for policy in POLICIES:
        real = run(real_engine(policy, str(profile_path), blocks), trace)
        sim_engine = simulated_engine(SchedulerConfig(policy=policy, max_batch_size=BATCH), cost, kv_cache_blocks=blocks)
        sim = run(sim_engine, trace)
        rows.append({"policy": policy, "real": real, "sim": sim})
    fcfs = rows[0]["real"]
    print(f"{'policy':16} {'real norm s/tok':>15} {'vs fcfs':>8} {'real TTFT s':>11} {'vs fcfs':>8} "
          f"{'sim norm':>9} {'err':>6} {'sim TTFT':>9} {'err':>6}")
    for r in rows:
        re, si = r["real"], r["sim"]
        err_n = si["mean_normalized_latency"] / re["mean_normalized_latency"] - 1
        err_t = si["mean_ttft"] / re["mean_ttft"] - 1
        r.update(err_normalized=err_n, err_ttft=err_t,
                 ratio_normalized=re["mean_normalized_latency"] / fcfs["mean_normalized_latency"],
                 ratio_ttft=re["mean_ttft"] / fcfs["mean_ttft"])
        print(f"{r['policy']:16} {re['mean_normalized_latency']:15.5f} {r['ratio_normalized']:8.3f} "
              f"{re['mean_ttft']:11.4f} {r['ratio_ttft']:8.3f} {si['mean_normalized_latency']:9.5f} "
              f"{100 * err_n:5.1f}% {si['mean_ttft']:9.4f} {100 * err_t:5.1f}%")
    if args.out:
        Path(args.out).write_text(json.dumps({"saturation_rps": sat, "rate": rate, "cv": args.cv,
                                              "num_requests": args.num_requests, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
