"""Real and simulated step traces side by side, and the serving path they reveal.

Both sides write the same StepRecord (engine/step_trace.py): the real engine with wall-clock
step starts, the simulator with virtual ones. `trace_summary` reduces a trace to the quantities
where a simulator can go wrong — how many steps, how full, how prefill is chunked, how long a
step lasts from one start to the next (the loop's own work between steps included), swap work —
computed the same way for both. `measure_path` finds the serving path outside the engine (HTTP,
tokenization, ZMQ in; ZMQ, detokenization, SSE out) from lone requests: with nothing else live,
a request's prompt runs in the first step after it was sent. `admissions` follows every request
of a run (by the ids a trace records per prefill slice) from its send to the step that began its
prompt and from that step to the client's first token, on either side.
No torch here.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.metrics import RequestRecord
from tokenslice.sim.serving_path import ServingPath
from tokenslice.engine.step_trace import StepRecord
from tokenslice.sim.trace_fit import l1_nnls

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


@dataclass(frozen=True)
class Admission:
    """One request's way to its first token. `wait_s`: from the client's send to the start of the
    step that ran its first prompt chunk; `steps_before`: the steps that began in that time (each
    one it could have joined); `first_s`: from that step's start to the client reading the token
    (comparable on both sides); `out_s`: from the end, as the trace timed it (schedule + execute +
    update; real traces only), of the step that computed the token (its prompt's last chunk) to
    the client reading it; `emitted`: the tokens that step produced, all streamed out together.
    `ingress_s`: bounds on when the engine got it — the core reads its socket just before a step
    starts, so after the step before that one began (exact when that step had ended before the
    send: the core sat idle on its socket)."""

    request_id: str
    wait_s: float
    steps_before: int
    first_s: float
    out_s: float
    ingress_s: tuple[float, float]
    live: int  # requests live in the engine when it was sent (the step before's)
    emitted: int = 0  # tokens produced by the step that computed its first token


def _end(step: StepRecord) -> float:
    return step.start + step.schedule_s + step.execute_s + step.update_s


def admissions(records: Sequence[RequestRecord], zero: float, steps: Sequence[StepRecord],
               engine_ids: Mapping[str, str] | None = None) -> list[Admission]:
    """Per request of a run whose steps recorded `prefill_ids`: `zero` is the clock time of the
    records' 0 (the run's wall start; 0.0 for the simulator), `engine_ids` maps a record's id to
    the engine's (the server's response id) where they differ."""
    first: dict[str, int] = {}
    chunks: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for rid in s.prefill_ids:
            first.setdefault(rid, i)
            chunks.setdefault(rid, []).append(i)
    starts = [s.start for s in steps]
    out = []
    for rec in records:
        rid = (engine_ids or {}).get(rec.request_id, rec.request_id)
        if rid not in first or rec.first_token_time is None:
            continue
        j = first[rid]
        step, prev = steps[j], steps[j - 1] if j else None
        sent, token = zero + rec.arrival, zero + rec.first_token_time
        wait = step.start - sent
        idle = prev is None or _end(prev) <= sent
        lo = wait if idle else max(0.0, prev.start - sent)
        live = 0 if prev is None else prev.running + prev.waiting + prev.preempted - prev.finished
        # The prompt's last chunk before the token: a later prefill of it (recompute) came after.
        last = steps[max(k for k in chunks[rid] if k == j or steps[k].start < token)]
        out.append(Admission(rec.request_id, wait, j - bisect.bisect_left(starts, sent, hi=j), token - step.start,
                             token - _end(last), (min(lo, wait), wait), live, last.sampled))
    return out


def admission_summary(adm: Sequence[Admission]) -> dict[str, Any]:
    """Means and medians of `admissions`, comparable between the real run and its simulation."""
    if not adm:
        return {"requests": 0}
    out: dict[str, Any] = {"requests": len(adm)}
    for key in ("wait_s", "steps_before", "first_s"):
        v = np.array([getattr(a, key) for a in adm], dtype=float)
        out[f"mean_{key}"], out[f"median_{key}"] = float(v.mean()), float(np.median(v))
    return out


def fit_egress(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(egress_s, egress_per_token_s) of ServingPath from (tokens the step emitted, seconds from
    its end to the client reading the token) per request, both non-negative: the slope of the
    least-absolute-error line (a few stalled deliveries do not tilt it), the intercept through
    the samples' mean (those stalls delay the clients' mean TTFT too, which the simulator is held
    to); the mean alone when the steps all emitted alike."""
    if not samples:
        raise ValueError("no egress samples")
    n = np.array([k for k, _ in samples], dtype=float)
    y = np.array([max(0.0, t) for _, t in samples])
    per = 0.0
    if len(set(n.tolist())) >= 2:
        per = float(l1_nnls(np.stack([np.ones_like(n), n], axis=1), y, np.ones_like(y))[1])
    return max(0.0, float(np.mean(y - per * n))), per


def egress_samples(adm: Sequence[Admission]) -> list[tuple[int, float]]:
    """`fit_egress`'s input from a run's `admissions`."""
    return [(a.emitted, a.out_s) for a in adm]


def path_under_load(adm: Sequence[Admission]) -> ServingPath:
    """The serving path as a loaded server's requests met it (`admissions` of a real run): in,
    the median of each request's ingress bounds' midpoint; out, `fit_egress` on the time from the
    end of the step that computed the first token to the client reading it."""
    if not adm:
        raise ValueError("no request of the run could be followed through the step trace")
    egress, per_token = fit_egress(egress_samples(adm))
    return ServingPath(float(np.median([(a.ingress_s[0] + a.ingress_s[1]) / 2 for a in adm])), egress,
                       egress_per_token_s=per_token)


def ingress_gap(steps: Sequence[StepRecord]) -> float:
    """The API server's time per request (ServingPath.ingress_gap_s) from the steps of a burst
    sent all at once to an idle engine: the engine holds more requests at each step (live, plus
    those finished since the burst began) until all have come through; the time that took over
    the requests it took in after the burst's first step."""
    finished, held = 0, []
    for s in steps:
        held.append((s.start, s.running + s.waiting + s.preempted + finished))
        finished += s.finished
    if not held:
        return 0.0
    (t0, k0), top = held[0], max(k for _, k in held)
    t_all = next(t for t, k in held if k == top)
    return (t_all - t0) / (top - k0) if top > k0 else 0.0


__all__ = ["steps_between", "step_periods", "trace_summary", "measure_path", "Admission", "admissions",
           "admission_summary", "fit_egress", "egress_samples", "path_under_load", "ingress_gap", "CLOCK_SLACK_S"]
