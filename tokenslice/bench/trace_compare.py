"""Real and simulated step traces side by side, and the serving path they reveal.

Both sides write the same StepRecord (engine/step_trace.py): the real engine with wall-clock
step starts, the simulator with virtual ones. `trace_summary` reduces a trace to the quantities
where a simulator can go wrong — how many steps, how full, how prefill is chunked, how long a
step lasts from one start to the next (the loop's own work between steps included), swap work —
computed the same way for both. `measure_path` finds the serving path outside the engine (HTTP,
tokenization, ZMQ in; ZMQ, detokenization, SSE out) from lone requests: with nothing else live,
a request's prompt runs in the first step after it was sent.
No torch here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenslice.bench.client import ClientRecord
from tokenslice.bench.serving_path import ServingPath
from tokenslice.engine.step_trace import StepRecord

# Step starts and client stamps come from two processes' clocks read at different moments:
# allow this much disorder when matching a sent request to the step that ran it.
CLOCK_SLACK_S = 1e-3


def steps_between(steps: Sequence[StepRecord], start: float, end: float) -> list[StepRecord]:
    """The steps that began within [start, end] (wall-clock seconds)."""
    return [s for s in steps if start <= s.start <= end]


def step_periods(steps: Sequence[StepRecord]) -> list[float]:
    """Start-to-start time of each step that another followed while work remained: the step
    itself plus the loop's work before the next one (sending outputs, reading new requests)."""
    # A next step that decodes continues requests that were live after the step before it, so
    # the engine did not sit idle waiting for arrivals in between.
    return [b.start - a.start for a, b in zip(steps, steps[1:]) if b.decode]


def trace_summary(steps: Sequence[StepRecord]) -> dict[str, Any]:
    """What a trace did, in numbers comparable between the real engine and the simulator."""
    if not steps:
        return {"steps": 0}
    periods = step_periods(steps)
    chunks = [q for s in steps for q, _ in s.prefill]
    return {
        "steps": len(steps),
        "mean_batch": float(np.mean([len(s.decode) + len(s.prefill) for s in steps])),
        "prefill_steps": sum(1 for s in steps if s.prefill),
        "mean_prefill_chunk": float(np.mean(chunks)) if chunks else 0.0,
        "median_period_s": float(np.median(periods)) if periods else None,
        "mean_period_s": float(np.mean(periods)) if periods else None,
        "swap_blocks": sum(s.swap_out_blocks + s.swap_in_blocks + s.async_blocks for s in steps),
        "dropped": sum(s.dropped for s in steps),
    }


def measure_path(lone: Sequence[tuple[float, ClientRecord]], steps: Sequence[StepRecord]) -> ServingPath:
    """The serving path from requests sent one at a time: (the run's wall-clock zero, its record)
    each. In: from the send to the start of the first prefill step after it. Out: from the end of
    that step (schedule + execute + update) to the client reading the first token. Medians."""
    ins, outs = [], []
    for zero, rec in lone:
        if rec.first_token_time is None:
            continue
        sent, first = zero + rec.arrival, zero + rec.first_token_time
        step = next((s for s in steps if s.prefill and s.start >= sent - CLOCK_SLACK_S), None)
        if step is None or step.start > first:
            continue
        end = step.start + step.schedule_s + step.execute_s + step.update_s
        ins.append(max(0.0, step.start - sent))
        outs.append(max(0.0, first - end))
    if not ins:
        raise RuntimeError("no lone request could be matched to a step of the server's step trace")
    return ServingPath(float(np.median(ins)), float(np.median(outs)))


__all__ = ["steps_between", "step_periods", "trace_summary", "measure_path", "CLOCK_SLACK_S"]
