"""Prefix caching on multi-turn chat (FastSwitch §3.3, vLLM automatic prefix caching), simulated.

ShareGPT conversations (sharegpt_multiturn_800.json, GPT-2 tokens, profile opt-13b@a100-40gb)
play as closed-loop sessions: a conversation's first turn arrives by Poisson, and each later
turn arrives a think time after the previous answer finished, its prompt the whole history
(every human turn and answer so far) plus the new human turn. The simulated model "samples"
the recorded answer token by token, so a later turn's prompt really continues the KV of the
turns before it. Each memory mode runs with prefix caching on and off; printed: prompt tokens
prefilled, tokens found in the cache (device / host), and p50 / mean TTFT of turns >= 2.

    nice -n 19 .venv/bin/python benchmarks/prefix_cache.py [--conversations 200] [--rate 1.0]
"""
from __future__ import annotations

import argparse
import heapq
import statistics
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tokenslice.bench.workloads import arrival_times, load_conversations
from tokenslice.config import SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import SamplingParams

SHARED = Path(__file__).resolve().parents[2] / "shared"
DATASET = SHARED / "data" / "sharegpt_multiturn_800.json"
TOKENIZER = SHARED / "tokenizers" / "gpt2"
PROFILE = "opt-13b@a100-40gb"
CONTEXT = 2048  # OPT's context: a conversation ends at the turn that would not fit
MAX_ANSWER = 512


class AnswerReplay:
    """A simulated executor whose sampled tokens are each request's recorded answer."""

    def __init__(self, inner: Any, answers: dict[str, list[int]]) -> None:
        self.inner = inner
        self.answers = answers

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        for s in plan.slices:
            if s.sample:
                result.sampled[s.request_id] = self.answers[s.request_id][s.num_output_tokens]
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def sessions(num: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, (prompt ids, answer ids) of each turn that fits the context."""
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    out = []
    for conv in load_conversations(DATASET)[:num]:
        history: list[int] = []
        turns = []
        for human, gpt in conv.turns:
            prompt = history + tok(human)["input_ids"]
            answer = tok(gpt)["input_ids"][:MAX_ANSWER] or [tok.eos_token_id]
            if not prompt or len(prompt) + len(answer) > CONTEXT:
                break
            turns.append((prompt, answer))
            history = prompt + answer
        if turns:
            out.append(turns)
    return out


def run(convs: list[list[tuple[list[int], list[int]]]], preemption: str, caching: bool, rate: float,
        think_s: float, kv_blocks: int) -> dict[str, Any]:
    cost = load_cost_model(PROFILE)
    cfg = SchedulerConfig(policy="fcfs", preemption=preemption, max_batch_size=64)
    eng = Engine.simulated(cfg, cost, kv_cache_blocks=kv_blocks, host_kv_blocks=4 * kv_blocks,
                           max_model_len=CONTEXT, enable_prefix_caching=caching)
    eng.fast_forward = False  # bulk decode would sample the placeholder, not the answers
    answers: dict[str, list[int]] = {}
    eng.executor = AnswerReplay(eng.executor, answers)
    prefilled = [0]
    schedule = eng.scheduler.schedule

    def counted(now: float) -> StepPlan:
        plan = schedule(now)
        prefilled[0] += sum(s.num_tokens for s in plan.prefill)
        return plan

    eng.scheduler.schedule = counted  # type: ignore[method-assign]
    pending = [(t, i, 0) for i, t in enumerate(arrival_times(len(convs), rate, 1.0, _rng()))]
    heapq.heapify(pending)
    turn_of: dict[str, tuple[int, int]] = {}
    reqs = []
    clock = eng.clock
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= clock.now():
            t, c, k = heapq.heappop(pending)
            prompt, answer = convs[c][k]
            rid = f"c{c}-t{k}"
            answers[rid] = answer
            turn_of[rid] = (c, k)
            reqs.append(eng.add_request(prompt, SamplingParams(max_tokens=len(answer), temperature=0.0, ignore_eos=True),
                                        request_id=rid, arrival_time=t))
        if not eng.has_unfinished():
            clock.advance_to(pending[0][0])
            continue
        for out in eng.step():
            if out.finished:
                c, k = turn_of[out.request_id]
                if k + 1 < len(convs[c]):
                    heapq.heappush(pending, (clock.now() + think_s, c, k + 1))
    later = [r.metrics.ttft for r in reqs if turn_of[r.request_id][1] >= 1]
    s = eng.scheduler.stats
    return {"requests": len(reqs), "later_turns": len(later), "prefill_tokens": prefilled[0],
            "device_hits": s.prefix_cache_device_hits, "host_hits": s.prefix_cache_host_hits,
            "p50_ttft_later": statistics.median(later) if later else None,
            "mean_ttft_later": statistics.fmean(later) if later else None}


def _rng() -> Any:
    import numpy as np

    return np.random.default_rng(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1.0, help="new conversations per second (Poisson)")
    ap.add_argument("--think-s", type=float, default=10.0, help="seconds between an answer and the next turn")
    ap.add_argument("--kv-blocks", type=int, default=14_000 // 16, help="device KV blocks of 16 tokens")
    ap.add_argument("--modes", default="recompute,reactive-swap")
    a = ap.parse_args()
    convs = sessions(a.conversations)
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
