"""SelfRefiner: which requests' hidden states the self length head reads each step, what it
predicts from them, and what it learns when they finish (predict/self_head.py).

A request is predicted once at the end of its prefill (the prompt's last token: its arrival
prediction) and again every `refine_every` generated tokens while it decodes (ELIS re-predicts
every 50 tokens, TRAIL every token; k is chosen by measurement, benchmarks/length/). The runner
copies the states out of the step's forward pass (StepPlan.hidden_layer, SeqSlice.capture_hidden),
so a prediction costs a small copy and a dot product, never a forward pass.

Time budget: predictions in one step may take at most `budget_s` by the measured cost of one
(a moving average). Prefill predictions always run (a request has no other); refinements that
do not fit wait, most overdue first, for a later step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenslice.plan import StepPlan
from tokenslice.predict.self_head import SelfLengthHead


@dataclass
class _Live:
    prompt_tokens: int
    predicted_at: int | None = None  # output tokens at the last prediction; None: none yet
    prompt_state: list[float] | None = None  # the prompt's last-token state, captured at prefill
    rows: list[tuple[int, list[float]]] = field(default_factory=list)  # (generated, hidden) captured


class SelfRefiner:
    def __init__(self, head: SelfLengthHead, path: Path | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        """`path`: where the head is saved after each online refit (None: never saved);
        `timer`: measures predictions (the budget's clock)."""
        self.head = head
        self.path = path
        self.timer = timer
        self.cost_s = 0.0  # one prediction, moving average; 0 until measured
        self._live: dict[str, _Live] = {}
        self._finished_since_fit = 0
        self.num_predictions = 0
        self.num_deferred = 0  # refinements that were due but waited for budget

    @property
    def layer(self) -> int:
        return self.head.config.layer

    def add(self, request_id: str, prompt_tokens: int) -> None:
        self._live[request_id] = _Live(prompt_tokens)

    def mark(self, plan: StepPlan) -> int:
        """Ask this step's forward pass for the states of the requests due a prediction (a head
        not ready yet reads the same states, to learn from); returns how many."""
        k = self.head.config.refine_every
        first, due = [], []
        for s in plan.slices:
            live = self._live.get(s.request_id)
            if live is None or not s.sample:
                continue
            if live.predicted_at is None:
                if s.start_pos + s.num_tokens >= live.prompt_tokens:  # the prompt's last token is in it
                    first.append(s)
            elif s.num_output_tokens - live.predicted_at >= k:
                due.append(s)
        if due and self.cost_s > 0:
            room = max(0, int((self.head.config.budget_s - len(first) * self.cost_s) // self.cost_s))
            if room < len(due):
                due.sort(key=lambda s: self._live[s.request_id].predicted_at - s.num_output_tokens)
                self.num_deferred += len(due) - room
                due = due[:room]
        for s in first + due:
            s.capture_hidden = True
        if first or due:
            plan.hidden_layer = self.layer
        return len(first) + len(due)

    def apply(self, hidden: Mapping[str, list[float]], output_tokens: Mapping[str, int]) -> dict[str, float]:
        """Predicted remaining tokens of each request whose state came back, counted from
        `output_tokens` (generated before the step that captured the state: its slice's
        num_output_tokens)."""
        ids = [rid for rid in hidden if rid in self._live]
        if not ids:
            return {}
        start = self.timer()
        done = np.array([output_tokens.get(rid, 0) for rid in ids])
        states = np.asarray([hidden[rid] for rid in ids], dtype=np.float64)
        prompts = np.array([self._live[rid].prompt_tokens for rid in ids])
        for rid in ids:
            if self._live[rid].predicted_at is None:  # this state is the prompt's
                self._live[rid].prompt_state = hidden[rid]
        for rid, t in zip(ids, done.tolist(), strict=True):
            live = self._live[rid]
            live.predicted_at = t
            live.rows.append((t, hidden[rid]))
        if not self.head.ready:  # still learning: the rows are kept, nothing is predicted
            return {}
        prompt_states = np.asarray([self._live[rid].prompt_state for rid in ids], dtype=np.float64)
        remaining = self.head.predict_remaining(states, prompts, done, prompt_states)
        per = (self.timer() - start) / len(ids)
        self.cost_s = per if self.cost_s == 0 else 0.9 * self.cost_s + 0.1 * per
        self.num_predictions += len(ids)
        return dict(zip(ids, remaining.tolist(), strict=True))

    def predicted_at(self, request_id: str) -> int | None:
        live = self._live.get(request_id)
        return None if live is None else live.predicted_at

    def finish(self, request_id: str, output_tokens: int, learn: bool) -> None:
        """The request ended with `output_tokens`; with `learn`, its captured states become
        training rows (remaining = output_tokens - generated at capture), refitting every
        `refit_every` finished requests."""
        live = self._live.pop(request_id, None)
        if live is None or not learn or not live.rows:
            return
        gen = np.array([t for t, _ in live.rows])
        self.head.add(np.asarray([h for _, h in live.rows]), np.full(len(gen), live.prompt_tokens), gen,
                      output_tokens - gen, np.asarray([live.prompt_state] * len(gen)))
        self.head.answers += 1
        self._finished_since_fit += 1
        if self._finished_since_fit >= self.head.config.refit_every:
            self._finished_since_fit = 0
            self.head.fit()
            if self.path is not None:
                self.head.save(self.path)

    def close(self) -> None:
        if self.path is not None and self.head.rows_since_fit:
            self.head.fit()
            self.head.save(self.path)


__all__ = ["SelfRefiner"]
