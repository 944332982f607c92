"""Trace replay (docs/DESIGN.md, Simulator): a workload's requests arrive at their times and each
generates exactly its output length. On the simulator's virtual clock idle gaps are skipped; on
a real engine the loop sleeps until the next arrival (benchmarks replay traces on both)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from tokenslice.engine.engine import Engine
from tokenslice.request import EngineRequest, Request, SamplingParams
from tokenslice.sim.clock import VirtualClock


class TraceItem(Protocol):
    """One request of a workload trace (bench.workloads.WorkloadRequest has these fields)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int


class PriorityUpdates(Protocol):
    """Priority changes during a trace replay (FastSwitch §4's patterns; bench.workloads has one).

    `initial(item)` is a request's priority at arrival; every `period` engine steps (1/f),
    `at_iteration(steps so far, live request ids)` returns the new priority of each request to change.
    """

    period: int

    def initial(self, item: Any) -> int: ...

    def at_iteration(self, iteration: int, live_request_ids: list[str]) -> dict[str, int]: ...


def replay(engine: Engine, trace: list[TraceItem], *, on_finish: Any = None,
           priority_updates: PriorityUpdates | None = None,
           on_advance: Callable[[float], None] | None = None, max_tokens_is_output: bool = False) -> list[Request]:
    """Run a workload trace: each request arrives at its time (clock-relative to the start)
    and generates exactly its output length, then stops as at an EOS (`Request.eos_after`);
    max_tokens is the context left, as a client that does not know the answer's length sends.
    With `max_tokens_is_output`, max_tokens is the output length instead, as a load client
    forcing lengths over HTTP sends it (bench/request_stream.py); the policies that read it (a
    prediction is capped at max_tokens) then see what the real server saw.
    Returns the requests, finished, in trace order. `on_finish(req)` is called as each finishes.

    `priority_updates` (FastSwitch §4) sets each request's priority at arrival, and after every
    `period` engine steps changes the live requests' priorities with `set_priority` before the
    next step; a fast-forwarded window ends at each update point, so the result is the same
    with fast_forward on or off. `on_advance(now)` is called after every step (or
    fast-forwarded window), e.g. to record the scheduler's state; it must not change it.
    """
    items = sorted(trace, key=lambda t: t.arrival_time)
    clock = engine.clock
    start = clock.now()
    reqs: dict[str, Request] = {}
    # A trace's priority labels and updates drive only policies that use them; the others
    # replay it unprioritized (a sweep compares them on the same trace).
    prioritized = engine.scheduler.policy.uses_priority
    if not prioritized:
        priority_updates = None
    period = priority_updates.period if priority_updates is not None else 0
    next_update = period
    i = 0
    while i < len(items) or engine.has_unfinished():
        now = clock.now()
        while i < len(items) and start + items[i].arrival_time <= now:
            item = items[i]
            real = getattr(item, "prompt_token_ids", None)
            ids = real or [0] * max(1, item.prompt_len)
            cap = item.output_len if max_tokens_is_output else engine.max_model_len - len(ids)
            params = SamplingParams(max_tokens=max(1, cap), temperature=0.0, ignore_eos=True)
            if priority_updates is not None:
                priority = priority_updates.initial(item)
            else:
                priority = (getattr(item, "priority", 0) or 0) if prioritized else 0
            reqs[item.request_id] = engine.add(EngineRequest(
                item.request_id, ids, params, start + item.arrival_time, getattr(item, "user", None), priority,
                expected_output_tokens=item.output_len,
                predicted_output_tokens=getattr(item, "predicted_output_tokens", None),
                eos_after=max(1, item.output_len), cache_prefix=bool(real)))  # placeholders share nothing
            i += 1
        if not engine.has_unfinished():
            _wait_until(clock, start + items[i].arrival_time)
            continue
        if priority_updates is not None and engine.num_steps >= next_update:
            changes = priority_updates.at_iteration(engine.num_steps, list(engine.scheduler.requests))
            for rid, priority in changes.items():
                engine.set_priority(rid, priority)
            next_update = (engine.num_steps // period + 1) * period
        horizon = start + items[i].arrival_time if i < len(items) else float("inf")
        max_steps = next_update - engine.num_steps if period else None
        _, finished = engine.advance(horizon, max_steps)
        if on_advance is not None:
            on_advance(clock.now())
        for req in finished:
            engine.forget_outputs(req.request_id)
            if on_finish is not None:
                on_finish(req)
    return [reqs[t.request_id] for t in trace]


def _wait_until(clock: Any, t: float) -> None:
    if isinstance(clock, VirtualClock):
        clock.advance_to(t)
    else:
        time.sleep(max(0.0, t - clock.now()))
