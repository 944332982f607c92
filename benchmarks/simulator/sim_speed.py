"""Simulator speed (scheduling benchmarks, part 4): 100,000 ShareGPT requests through skip-join-mlfq,
and the scheduler's decision time with 1,000 and 10,000 live requests (the policy's and vtc's,
with prefix-cache lookups). `--num-requests 0` times the decisions only.

    .venv/bin/python benchmarks/simulator/sim_speed.py [--num-requests 100000] [--policy skip-join-mlfq]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from tokenslice.bench.workloads import make_workload
from tokenslice.config import SchedulerConfig
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.predict.cost import load_cost_model

SHARED = Path(__file__).resolve().parents[3] / "shared"


def whole_run(policy: str, n: int, load: float) -> None:
    cost = load_cost_model("opt-13b@a100-40gb")
    base = dict(dataset=SHARED / "data" / "sharegpt_multiturn_800.json", tokenizer=SHARED / "tokenizers" / "gpt2",
                length_filter=True, seed=0)
    # Saturation of fcfs on a short burst sets the rate; the timed run is then at `load` of it.
    burst = make_workload("sharegpt", num_requests=2000, rate=None, **base)
    sat_eng = simulated_engine(SchedulerConfig(policy="fcfs", max_batch_size=16), cost, kv_cache_blocks=1 << 20)
    replay(sat_eng, burst)
    rate = load * len(burst) / sat_eng.clock.now()
    work = make_workload("sharegpt", num_requests=n, rate=rate, cv=1.0, **base)
    eng = simulated_engine(SchedulerConfig(policy=policy, max_batch_size=16), cost, kv_cache_blocks=1 << 20)
    t = time.perf_counter()
    reqs = replay(eng, work)
    wall = time.perf_counter() - t
    tokens = sum(r.num_output_tokens for r in reqs)
    print(f"{policy}: {n} ShareGPT requests at {rate:.2f} req/s (load {load}), {tokens} output tokens, "
          f"{eng.num_steps} iterations simulated in {wall:.1f} s wall ({eng.clock.now():.0f} s simulated)")


def decision_time(policy: str, live: int, trials: int = 200, users: int = 8) -> tuple[float, float]:
    """Median and p99 wall time of one schedule() with `live` requests waiting or paused. Prompts
    are distinct random token ids behind a shared 64-token system prompt, so every admission does
    a real prefix-cache lookup (a hit on the shared part); requests spread over `users` (vtc)."""
    cost = load_cost_model("opt-13b@a100-40gb")
    work = make_workload("synthetic-lognormal", num_requests=live, rate=None, seed=1, input_len=200, output_len=300,
                         num_users=users)
    eng = simulated_engine(SchedulerConfig(policy=policy, max_batch_size=16), cost, kv_cache_blocks=1 << 22)
    rng = random.Random(1)
    system = [rng.randrange(1, 50_000) for _ in range(64)]
    for w in work:
        prompt = system + [rng.randrange(1, 50_000) for _ in range(w.prompt_len)]
        eng.add_request(prompt, _params(w.output_len), request_id=w.request_id, arrival_time=0.0,
                        expected_output_tokens=w.output_len, user=w.user)
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        plan = eng.scheduler.schedule(eng.clock.now())
        times.append(time.perf_counter() - t)
        result = eng.executor.execute(plan)
        eng.clock.advance(result.step_seconds)
        eng.scheduler.update(plan, result, eng.clock.now())
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def _params(n: int):
    from tokenslice.request import SamplingParams

    return SamplingParams(max_tokens=max(1, n), temperature=0.0, ignore_eos=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=100_000)
    ap.add_argument("--policy", default="skip-join-mlfq")
    ap.add_argument("--load", type=float, default=0.8)
    args = ap.parse_args()
    for policy in dict.fromkeys([args.policy, "vtc"]):  # vtc: per-user counters on top of the lookups
        for live in (1_000, 10_000):
            med, p99 = decision_time(policy, live)
            print(f"{policy}: schedule() with {live} live requests: median {med * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms")
    if args.num_requests:
        whole_run(args.policy, args.num_requests, args.load)


if __name__ == "__main__":
    main()
