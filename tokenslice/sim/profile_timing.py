"""What `tokenslice profile` times (sim/profiler.py): a grid of real steps and the KV copies.

The grid holds lone and batched prefills of several lengths, chunked prefills over a cached
prefix, decodes at several batch sizes and context lengths, and a few mixed batches; each step
runs with its own block tables from a KVManager and is timed as the simulator will see it (its
BatchShape is `SimulatedExecutor.shape` of the plan). Copies of N blocks' worth of bytes between
device and host (pinned host memory on CUDA; on CPU a host-to-host copy, which is what a CPU
"swap" costs) are timed as one copy and as N per-block copies.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenslice.kv.manager import KVManager
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.predict.cost import BatchShape
from tokenslice.request import SamplingParams
from tokenslice.sim.executor import SimulatedExecutor

# Transfer sizes stop at this many bytes per copy: enough to see bandwidth, quick on 2 CPU cores.
MAX_TRANSFER_BYTES = 64 << 20


@dataclass(frozen=True)
class GridPoint:
    """One step to measure: prefill chunks as (new tokens, cached tokens) and decode contexts."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()

    def total_tokens_per_seq(self) -> list[int]:
        return [q + past for q, past in self.prefill] + list(self.decode)

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill and self.decode else "prefill" if self.prefill else "decode"


@dataclass
class GridTarget:
    """Where grid steps run: `execute(plan)` on `device` (timing waits for it there), then
    `forget(ids)` drops the steps' per-request state (the sampler's)."""

    execute: Callable[[StepPlan], Any]
    forget: Callable[[list[str]], None]
    device: torch.device


def _powers(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


def profile_grid(max_batch_size: int, max_context: int, max_tokens_per_step: int) -> list[GridPoint]:
    """The full grid: prefills, chunked prefills, decodes and mixed steps within the limits."""
    ctx_cap = max_context - 1  # leave room for the sampled token
    grid: list[GridPoint] = []
    for length in _powers(16, min(ctx_cap, max_tokens_per_step)):
        for b in (1, 2, 4):
            if b * length <= max_tokens_per_step and b <= max_batch_size:
                grid.append(GridPoint(prefill=((length, 0),) * b))
    for q in (32, 128):
        for past in (128, 512):
            if q + past <= ctx_cap:
                grid.append(GridPoint(prefill=((q, past),)))
    batches = sorted({b for b in _powers(1, max_batch_size)} | {max_batch_size})
    contexts = sorted({c for c in (16, 64, 256, 1024) if c <= ctx_cap} | {ctx_cap})
    for b in batches:
        for c in contexts:
            grid.append(GridPoint(decode=(c,) * b))
    # Mixed steps (a decode batch plus a newcomer's prefill) are what continuous batching runs
    # most under load; each attention group has a fixed cost the fit must see.
    for b in sorted({1, 2, max(2, max_batch_size // 2), max(1, max_batch_size - 1)}):
        for length in (16, 32, 128):
            for ctx in sorted({min(64, ctx_cap), min(256, ctx_cap)}):
                if length <= ctx_cap and length + b <= max_tokens_per_step and b < max_batch_size:
                    grid.append(GridPoint(prefill=((length, 0),), decode=(ctx,) * b))
    return grid


def reduce_grid(grid: Sequence[GridPoint], samples: int | None) -> list[GridPoint]:
    """`samples` points spread evenly over the grid (which is ordered by kind, so every kind keeps
    its share), always keeping the first and last."""
    if samples is None or samples >= len(grid):
        return list(grid)
    if samples < 6:
        raise ValueError(f"--samples must be at least 6 (the fit has 5 coefficients), got {samples}")
    idx = sorted({int(round(i)) for i in np.linspace(0, len(grid) - 1, samples)})
    return [grid[i] for i in idx]


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (timing on CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(point: GridPoint, kv: KVManager, vocab: int, rng: np.random.Generator,
          tag: str) -> tuple[StepPlan, list[str]]:
    """A StepPlan for the point, with fresh block tables; returns it and the ids to free after."""
    params = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    plan = StepPlan()
    ids: list[str] = []
    for i, (q, past) in enumerate(point.prefill):
        rid = f"{tag}-p{i}"
        kv.ensure(rid, past + q)
        toks = rng.integers(0, vocab, size=q).tolist()
        plan.prefill.append(SeqSlice(rid, toks, past, kv.block_table(rid), True, params, 0))
        ids.append(rid)
    for i, ctx in enumerate(point.decode):
        rid = f"{tag}-d{i}"
        kv.ensure(rid, ctx)
        plan.decode.append(SeqSlice(rid, [int(rng.integers(0, vocab))], ctx - 1, kv.block_table(rid), True,
                                    params, 1))
        ids.append(rid)
    return plan, ids


def time_point(target: GridTarget, point: GridPoint, kv: KVManager, vocab: int, rng: np.random.Generator,
               tag: str) -> tuple[BatchShape, float]:
    """Wall seconds of one execution of the point's plan (built with fresh block tables)."""
    plan, ids = _plan(point, kv, vocab, rng, tag)
    try:
        sync_device(target.device)
        t0 = time.perf_counter()
        target.execute(plan)
        sync_device(target.device)
        return SimulatedExecutor.shape(plan), time.perf_counter() - t0
    finally:
        for rid in ids:
            kv.free(rid)
        target.forget(ids)


def time_grid(target: GridTarget, points: Sequence[GridPoint], kv: KVManager, vocab: int, repeats: int,
              rng: np.random.Generator,
              progress: Callable[[int, int], None] | None = None) -> list[tuple[BatchShape, float]]:
    """Median of `repeats` timings per point, after one untimed warm-up pass.

    Passes sweep the whole grid, so a point's repeats are spread over the run and one burst of
    outside load cannot spoil them all. The median, not the minimum: the engine lives with typical
    steps, and best-case times made simulated queues systematically shorter than the real ones
    (fcfs latency half the real value near saturation, where queueing magnifies small errors).
    """
    times: list[list[float]] = [[] for _ in points]
    shapes: list[BatchShape | None] = [None] * len(points)
    total = (repeats + 1) * len(points)
    for r in range(repeats + 1):
        for i, p in enumerate(points):
            shape, secs = time_point(target, p, kv, vocab, rng, f"r{r}-g{i}")
            shapes[i] = shape
            if r:  # pass 0 pays for lazy init and first-shape costs
                times[i].append(secs)
            if progress:
                progress(r * len(points) + i + 1, total)
    return [(shape, float(np.median(t))) for shape, t in zip(shapes, times, strict=True) if shape is not None]


def measure_transfer(block_bytes: int, device: torch.device, repeats: int = 3,
                     max_bytes: int = MAX_TRANSFER_BYTES) -> list[tuple[int, int, float]]:
    """(bytes, ops, seconds) for copies of N blocks, each as one copy and as N per-block copies,
    in both directions (device->host is swap-out, host->device swap-in)."""
    elems = max(block_bytes // 4, 1)  # float32 stand-in: only bytes matter to the link
    counts = [n for n in (1, 8, 64, 512, 4096) if n * elems * 4 <= max_bytes] or [1]
    pin = device.type == "cuda"
    big = counts[-1] * elems
    dev = torch.empty(big, dtype=torch.float32, device=device)
    host = torch.empty(big, dtype=torch.float32, pin_memory=pin)
    dev.fill_(1.0)
    host.fill_(1.0)
    out: list[tuple[int, int, float]] = []
    for n in counts:
        for many in (False, True):
            if many and n == 1:
                continue
            for src, dst in ((dev, host), (host, dev)):
                times = []
                for r in range(repeats + 1):
                    sync_device(device)
                    t0 = time.perf_counter()
                    if many:
                        for i in range(n):
                            dst[i * elems:(i + 1) * elems].copy_(src[i * elems:(i + 1) * elems], non_blocking=pin)
                    else:
                        dst[:n * elems].copy_(src[:n * elems], non_blocking=pin)
                    sync_device(device)
                    if r:
                        times.append(time.perf_counter() - t0)
                out.append((n * elems * 4, n if many else 1, float(np.min(times))))
    return out


def grid_blocks(point: GridPoint, block_size: int) -> int:
    """KV blocks the point's sequences hold."""
    return sum(-(-t // block_size) for t in point.total_tokens_per_seq())
