"""Multi-turn chat sessions on the simulator, shared by the benchmarks that replay them
(prefix_cache.py, fastswitch_sim.py).

ShareGPT conversations (sharegpt_multiturn_800.json, GPT-2 tokens) play as closed-loop sessions:
a conversation's first turn arrives by Poisson, and each later turn arrives a think time after
the previous answer finished, its prompt the whole history (every human turn and answer so far)
plus the new human turn. The simulated model "samples" the recorded answer token by token, so a
later turn's prompt really continues the KV of the turns before it (FastSwitch §3.3's reuse).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.datasets import load_conversations
from tokenslice.bench.priority_patterns import PriorityUpdates
from tokenslice.engine.engine import Engine
from tokenslice.plan import StepPlan, StepResult
from tokenslice.request import Request, SamplingParams

SHARED = Path(__file__).resolve().parents[3] / "shared"
DATASET = SHARED / "data" / "sharegpt_multiturn_800.json"
TOKENIZER = SHARED / "tokenizers" / "gpt2"
MAX_ANSWER = 512

Turn = tuple[list[int], list[int]]  # (prompt ids: history + human turn, recorded answer ids)


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


def sessions(num: int, context: int, max_answer: int = MAX_ANSWER) -> list[list[Turn]]:
    """Per conversation (the first `num`), its turns that fit `context` tokens; a conversation
    ends at the first turn that would not fit."""
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    out = []
    for conv in load_conversations(DATASET)[:num]:
        history: list[int] = []
        turns = []
        for human, gpt in conv.turns:
            prompt = history + tok(human)["input_ids"]
            answer = tok(gpt)["input_ids"][:max_answer] or [tok.eos_token_id]
            if not prompt or len(prompt) + len(answer) > context:
                break
            turns.append((prompt, answer))
            history = prompt + answer
        if turns:
            out.append(turns)
    return out


@dataclass(frozen=True)
class _Id:
    """A turn's id before its request exists: what PriorityUpdates.initial reads."""

    request_id: str


@dataclass
class SessionRun:
    """What a session replay leaves: every turn's request (arrival order) and its (conversation,
    turn) index, and the prompt tokens prefilled (recomputation after a drop included)."""

    requests: list[Request] = field(default_factory=list)
    turn_of: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefill_tokens: int = 0


def play_sessions(eng: Engine, convs: list[list[Turn]], rate: float, think_s: float, seed: int = 0,
                  priority_updates: PriorityUpdates | None = None) -> SessionRun:
    """Replay `convs` on a simulated engine: conversations start by Poisson at `rate` per second,
    a later turn arrives `think_s` after the previous answer. With `priority_updates` (FastSwitch
    §4) each turn gets a priority at arrival and every `period` steps the live ones change."""
    eng.fast_forward = False  # bulk decode would sample the placeholder, not the answers
    answers: dict[str, list[int]] = {}
    eng.executor = AnswerReplay(eng.executor, answers)
    run = SessionRun()
    schedule = eng.scheduler.schedule

    def counted(now: float) -> StepPlan:
        plan = schedule(now)
        run.prefill_tokens += sum(s.num_tokens for s in plan.prefill)
        return plan

    eng.scheduler.schedule = counted  # type: ignore[method-assign]
    starts = arrival_times(len(convs), rate, 1.0, np.random.default_rng(seed))
    pending = [(t, i, 0) for i, t in enumerate(starts)]
    heapq.heapify(pending)
    period = priority_updates.period if priority_updates is not None else 0
    next_update = period
    clock = eng.clock
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= clock.now():
            t, c, k = heapq.heappop(pending)
            prompt, answer = convs[c][k]
            rid = f"c{c}-t{k}"
            answers[rid] = answer
            run.turn_of[rid] = (c, k)
            params = SamplingParams(max_tokens=len(answer), temperature=0.0, ignore_eos=True)
            priority = priority_updates.initial(_Id(rid)) if priority_updates else 0
            run.requests.append(eng.add_request(prompt, params, request_id=rid, arrival_time=t, priority=priority))
        if not eng.has_unfinished():
            clock.advance_to(pending[0][0])
            continue
        if priority_updates is not None and eng.num_steps >= next_update:
            live = list(eng.scheduler.requests)
            for rid, level in priority_updates.at_iteration(eng.num_steps, live).items():
                eng.set_priority(rid, level)
            next_update = (eng.num_steps // period + 1) * period
        for out in eng.step():
            if out.finished:
                c, k = run.turn_of[out.request_id]
                if k + 1 < len(convs[c]):
                    heapq.heappush(pending, (clock.now() + think_s, c, k + 1))
    return run
