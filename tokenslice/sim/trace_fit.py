"""Fit and check the cost model on step traces (engine/step_trace.py): what a real engine did.

A step's wall time — from its start to the next step's start — is the forward pass (the
executor's `step_seconds`, synchronous KV copies included) plus the loop's own work around it:
scheduling, bookkeeping, sending outputs, taking in arrivals. The traces show that work grows with
the live requests the policy ranks every step, the tokens the step emits and the requests that
arrive between two steps (ALISE §3.1 models only the forward pass; Vidur §4 adds the CPU overheads
separately, as here). So the fit has three parts, each on what the trace measured directly:

- forward: `PROFILE_FEATURES` of the batch on `step_seconds - transfer_seconds`, optionally with
  a grid profile's timed batches beside them (a short trace holds few large batches, and a fit
  on small ones alone can put too much on each sequence: it then runs the large ones slow);
- copies: `fit_transfer` on the synchronous swaps' bytes, copy runs and `transfer_seconds`;
- loop: `LOOP_FEATURES` on wall time minus `step_seconds`.

Each is a non-negative fit minimising relative absolute error (iteratively reweighted least
squares): the error measure the evaluation reports, and robust to the timing spikes a shared
machine adds. Those spikes still cost throughput, so by default forward and loop terms are then
scaled together until the fitted steps add up to the traced wall time. A step after which
nothing was left to run is left out of the loop fit and the evaluation: its wall time includes
waiting for the next request.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from tokenslice.config import CacheConfig
from tokenslice.engine.step_trace import StepRecord, load_step_trace
from tokenslice.sim.executor import offload_block_bytes
from tokenslice.predict.cost import BatchShape, CostModel, LoopShape, TransferSpec
from tokenslice.predict.fit import fit_transfer, nnls
from tokenslice.predict.profile import (LOOP_FEATURES, PROFILE_FEATURES, ProfileCostModel, loop_features,
                                        profile_features)

STEP_KINDS = ("prefill", "decode", "mixed", "swap", "empty")


@dataclass(frozen=True)
class TracedStep:
    """One traced step, reduced to what the cost model predicts and what it is checked against."""

    shape: BatchShape
    loop: LoopShape  # arrivals: requests added between this step and the next
    step_seconds: float  # the executor's, synchronous copies included
    transfer_seconds: float  # the synchronous copies alone
    copy_blocks: int  # synchronously copied blocks, both directions
    copy_runs: int  # the contiguous copies they coalesce into
    wall_seconds: float | None  # start to the next step's start; None: last step, or the engine idled after it
    kind: str  # one of STEP_KINDS: "swap" when it moved KV, else by the batch

    @property
    def forward_seconds(self) -> float:
        return self.step_seconds - self.transfer_seconds


def traced_steps(records: Sequence[StepRecord]) -> list[TracedStep]:
    """The steps of one trace, in order."""
    out = []
    for i, r in enumerate(records):
        live = r.running + r.waiting + r.preempted
        left = live - r.finished
        nxt = records[i + 1] if i + 1 < len(records) else None
        busy = nxt is not None and left > 0 and nxt.step == r.step + 1
        arrivals = max(nxt.running + nxt.waiting + nxt.preempted - left, 0) if nxt is not None else 0
        shape = BatchShape.from_lengths(prefill=[(q, past) for q, past in r.prefill], decode=r.decode)
        moved = r.swap_out_blocks + r.swap_in_blocks + r.async_blocks
        kind = ("swap" if moved else "empty" if shape.is_empty() else
                "mixed" if r.prefill and r.decode else "prefill" if r.prefill else "decode")
        out.append(TracedStep(shape, LoopShape(live, r.sampled, arrivals), r.step_seconds, r.transfer_seconds,
                              r.swap_out_blocks + r.swap_in_blocks, r.swap_out_runs + r.swap_in_runs,
                              nxt.start - r.start if busy and nxt is not None else None, kind))
    return out


def l1_nnls(a: np.ndarray, y: np.ndarray, weights: np.ndarray, iters: int = 50) -> np.ndarray:
    """min sum_i weights_i * |a_i . x - y_i| over x >= 0, by iteratively reweighted NNLS started
    from the weighted least-squares fit."""
    norms = np.linalg.norm(a * weights[:, None], axis=0)
    scale = np.where(norms > 0, norms, 1.0)  # columns span ~1 to ~1e6
    a = a / scale
    floor = 1e-4 * float(np.median(np.abs(y))) or 1e-12  # residuals below this count as this
    rows = weights ** 2
    x = np.zeros(a.shape[1])
    for _ in range(iters):
        sw = np.sqrt(rows)
        new = nnls(a * sw[:, None], y * sw)
        if np.allclose(new, x, rtol=1e-7, atol=0.0):
            x = new
            break
        x = new
        rows = weights / np.maximum(np.abs(a @ x - y), floor)
    return x / scale


def _relative_fit(a: np.ndarray, y: np.ndarray, wall: np.ndarray) -> np.ndarray:
    return l1_nnls(a, y, 1.0 / np.maximum(wall, 1e-9))


def _forward_fit(fwd: Sequence[TracedStep], grid: Sequence[tuple[BatchShape, float]]) -> np.ndarray:
    """Coefficients over PROFILE_FEATURES of the traced forward passes and the timed grid batches."""
    y = np.array([s.forward_seconds for s in fwd])
    a = np.array([profile_features(s.shape) for s in fwd])
    weights = 1.0 / np.maximum(y, 1e-9)
    timed_grid = [(shape, t) for shape, t in grid if t > 0]
    if timed_grid:
        yg = np.array([t for _, t in timed_grid])
        wg = len(fwd) / len(timed_grid) / yg  # relative error, the grid as a whole as heavy as the trace
        a = np.vstack([a, np.array([profile_features(shape) for shape, _ in timed_grid])])
        y, weights = np.concatenate([y, yg]), np.concatenate([weights, wg])
    return l1_nnls(a, y, weights)


def _link_fit(steps: Sequence[TracedStep], block_bytes: int, transfer: TransferSpec) -> TransferSpec:
    """The host link fitted on the steps' synchronous copies; `transfer` when they are too few."""
    copies = [(s.copy_blocks * block_bytes, s.copy_runs, s.transfer_seconds) for s in steps
              if s.copy_blocks and s.transfer_seconds > 0]
    if len({b for b, _, _ in copies}) >= 2:
        try:
            return fit_transfer(copies)
        except ValueError:
            pass  # copies too noisy to see bandwidth in: keep the measured link
    return transfer


def fit_steps(steps: Sequence[TracedStep], *, kv_bytes_per_token: int, block_bytes: int,
              transfer: TransferSpec, model: str = "unknown", device: str = "unknown",
              tensor_parallel: int = 1, match_total: bool = True,
              grid: Sequence[tuple[BatchShape, float]] = ()) -> ProfileCostModel:
    """A profile fitted on traced steps (module doc). `transfer` is used when the steps hold too
    few synchronous copies to fit the link on; `block_bytes` is one KV block as copied. `grid`:
    (batch, forward seconds) timed by `tokenslice profile`, fitted with the traced forward passes,
    weighted to count as much in all as they do.

    The fits predict the typical step. With `match_total`, forward and loop terms are then scaled
    together so that the timed steps add up to their measured wall time: the stalls a busy machine
    adds (a preempted process, a garbage collection) are rare but long, and the engine's throughput,
    which queueing magnifies, pays for them all."""
    fwd = [s for s in steps if not s.shape.is_empty() and s.forward_seconds > 0]
    if len(fwd) < len(PROFILE_FEATURES):
        raise ValueError(f"traces hold {len(fwd)} steps with a batch; the fit needs at least {len(PROFILE_FEATURES)}")
    coef = _forward_fit(fwd, grid)
    transfer = _link_fit(steps, block_bytes, transfer)

    timed = [s for s in steps if s.wall_seconds is not None]
    loop = np.zeros(len(LOOP_FEATURES))
    wall = np.array([s.wall_seconds for s in timed], dtype=float)
    if len(timed) >= len(LOOP_FEATURES):
        overhead = wall - np.array([s.step_seconds for s in timed])
        loop = _relative_fit(np.array([loop_features(s.loop) for s in timed]), overhead, wall)

    def profile(scale: float) -> ProfileCostModel:
        return ProfileCostModel(coefficients=dict(zip(PROFILE_FEATURES, (float(c) * scale for c in coef), strict=True)),
                                transfer=transfer, kv_bytes_per_token=kv_bytes_per_token, model=model, device=device,
                                samples=len(fwd), tensor_parallel=tensor_parallel,  # r^2 means little under stalls
                                loop=dict(zip(LOOP_FEATURES, (float(c) * scale for c in loop), strict=True)))

    cost = profile(1.0)
    if match_total and len(timed):
        copies_s = sum(_copy_seconds(cost, s, block_bytes) for s in timed)  # the link is not scaled
        predicted = sum(predicted_wall_seconds(cost, s, block_bytes) for s in timed) - copies_s
        if predicted > 0:
            cost = profile((float(wall.sum()) - copies_s) / predicted)
    return cost


def grid_measurements(path: str | Path) -> list[tuple[BatchShape, float]]:
    """The timed batches a `tokenslice profile` JSON keeps beside its fit, for `fit_steps`'s grid."""
    data = json.loads(Path(path).read_text())
    if not data.get("measurements"):
        raise ValueError(f"{path} holds no grid measurements (a profile written by `tokenslice profile`)")
    names = {f.name for f in fields(BatchShape)}
    return [(BatchShape(**{k: v for k, v in m.items() if k in names}), float(m["seconds"])) for m in data["measurements"]]


def _copy_seconds(cost: CostModel, step: TracedStep, block_bytes: int) -> float:
    return cost.transfer_seconds(step.copy_blocks * block_bytes, step.copy_runs) if step.copy_blocks else 0.0


def predicted_wall_seconds(cost: CostModel, step: TracedStep, block_bytes: int) -> float:
    """What the simulator's clock advances by for this step: forward, synchronous copies, loop."""
    return cost.iteration_seconds(step.shape) + _copy_seconds(cost, step, block_bytes) + cost.loop_seconds(step.loop)


@dataclass(frozen=True)
class ErrorStats:
    """|predicted - actual| / actual over a set of steps; `bias` is the median signed error
    (negative: the model is optimistic), `total` the error of the steps' summed time."""

    steps: int
    median: float
    p90: float
    p99: float
    bias: float
    total: float  # sum predicted / sum actual - 1: the error in throughput over these steps

    @classmethod
    def of(cls, predicted: np.ndarray, actual: np.ndarray) -> ErrorStats:
        rel = (predicted - actual) / actual
        med, p90, p99 = np.percentile(np.abs(rel), [50, 90, 99])
        return cls(len(rel), float(med), float(p90), float(p99), float(np.median(rel)),
                   float(predicted.sum() / actual.sum() - 1))


def evaluate_steps(cost: CostModel, steps: Sequence[TracedStep], block_bytes: int) -> dict[str, ErrorStats]:
    """Per-step relative error of the predicted wall time: "all", then each step kind present,
    then "forward" (the forward pass alone against the executor's step time)."""
    timed = [s for s in steps if s.wall_seconds]
    if not timed:
        raise ValueError("the trace has no timed steps (a step followed by another with work left)")
    pred = np.array([predicted_wall_seconds(cost, s, block_bytes) for s in timed])
    wall = np.array([s.wall_seconds for s in timed], dtype=float)
    kinds = np.array([s.kind for s in timed])
    out = {"all": ErrorStats.of(pred, wall)}
    for kind in STEP_KINDS:
        if (kinds == kind).any():
            out[kind] = ErrorStats.of(pred[kinds == kind], wall[kinds == kind])
    fwd = [s for s in steps if not s.shape.is_empty() and s.forward_seconds > 0]
    if fwd:
        out["forward"] = ErrorStats.of(np.array([cost.iteration_seconds(s.shape) for s in fwd]),
                                       np.array([s.forward_seconds for s in fwd]))
    return out


def evaluate_trace(cost: CostModel, path: str | Path, block_size: int = CacheConfig.block_size
                   ) -> dict[str, ErrorStats]:
    """`evaluate_steps` on a trace file recorded with KV blocks of `block_size` tokens."""
    return evaluate_steps(cost, traced_steps(load_step_trace(path)),
                          offload_block_bytes(block_size, cost.kv_bytes_per_token))


def describe_errors(errors: dict[str, ErrorStats]) -> str:
    lines = [f"{'steps':<8} {'n':>7} {'median':>8} {'p90':>8} {'p99':>8} {'bias':>8} {'total':>8}"]
    lines += [f"{name:<8} {e.steps:>7} {e.median:>8.1%} {e.p90:>8.1%} {e.p99:>8.1%} {e.bias:>+8.1%} {e.total:>+8.1%}"
              for name, e in errors.items()]
    return "\n".join(lines)


__all__ = ["STEP_KINDS", "TracedStep", "traced_steps", "l1_nnls", "fit_steps", "grid_measurements", "predicted_wall_seconds",
           "ErrorStats", "evaluate_steps", "evaluate_trace", "describe_errors"]
