"""Prefix caching on multi-turn chat (FastSwitch §3.3, vLLM automatic prefix caching), simulated.

ShareGPT conversations (sharegpt_multiturn_800.json, GPT-2 tokens, profile opt-13b@a100-40gb)
play as closed-loop sessions: a conversation's first turn arrives by Poisson, and each later
turn arrives a think time after the previous answer finished, its prompt the whole history
(every human turn and answer so far) plus the new human turn. The simulated model "samples"
the recorded answer token by token, so a later turn's prompt really continues the KV of the
turns before it. Each memory mode runs with prefix caching on and off; printed: prompt tokens
prefilled, tokens found in the cache (device / host), and p50 / mean TTFT of turns >= 2.

    nice -n 19 .venv/bin/python benchmarks/scheduling/prefix_cache.py [--conversations 200] [--rate 1.0]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

from multiturn import Turn, play_sessions, sessions
from tokenslice.config import SchedulerConfig
from tokenslice.sim.engine import simulated_engine
from tokenslice.predict.cost import load_cost_model

PROFILE = "opt-13b@a100-40gb"
CONTEXT = 2048  # OPT's context: a conversation ends at the turn that would not fit


def run(convs: list[list[Turn]], preemption: str, caching: bool, rate: float, think_s: float,
        kv_blocks: int) -> dict[str, Any]:
    cost = load_cost_model(PROFILE)
    cfg = SchedulerConfig(policy="fcfs", preemption=preemption, max_batch_size=64)
    eng = simulated_engine(cfg, cost, kv_cache_blocks=kv_blocks, host_kv_blocks=4 * kv_blocks,
                           max_model_len=CONTEXT, enable_prefix_caching=caching)
    r = play_sessions(eng, convs, rate, think_s)
    later = [q.metrics.ttft for q in r.requests if r.turn_of[q.request_id][1] >= 1]
    s = eng.scheduler.stats
    return {"requests": len(r.requests), "later_turns": len(later), "prefill_tokens": r.prefill_tokens,
            "device_hits": s.prefix_cache_device_hits, "host_hits": s.prefix_cache_host_hits,
            "p50_ttft_later": statistics.median(later) if later else None,
            "mean_ttft_later": statistics.fmean(later) if later else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1.0, help="new conversations per second (Poisson)")
    ap.add_argument("--think-s", type=float, default=10.0, help="seconds between an answer and the next turn")
    ap.add_argument("--kv-blocks", type=int, default=14_000 // 16, help="device KV blocks of 16 tokens")
    ap.add_argument("--modes", default="recompute,reactive-swap")
    a = ap.parse_args()
    convs = sessions(a.conversations, CONTEXT)
    print(f"{len(convs)} conversations, {sum(len(c) for c in convs)} turns; {PROFILE}, fcfs, "
          f"{a.kv_blocks} device blocks (host 4x), rate {a.rate}/s, think {a.think_s}s")
    print("mode            caching  prefill_tokens  device_hits  host_hits  p50_ttft_t2+  mean_ttft_t2+")
    for mode in a.modes.split(","):
        for caching in (False, True):
            r = run(convs, mode, caching, a.rate, a.think_s, a.kv_blocks)
            print(f"{mode:15s} {'on' if caching else 'off':7s}  {r['prefill_tokens']:14d}  {r['device_hits']:11d}  "
                  f"{r['host_hits']:9d}  {r['p50_ttft_later']:12.4f}  {r['mean_ttft_later']:13.4f}", flush=True)


if __name__ == "__main__":
    main()
