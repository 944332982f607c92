"""`tokenslice profile`: measure the real model on this machine and fit the linear cost model.

ALISE §3.1 models an iteration's time as linear in the batch's token counts. We run a grid of real
steps through the engine's ModelRunner — lone and batched prefills of several lengths, chunked
prefills over a cached prefix, decodes at several batch sizes and context lengths, and a few mixed
batches — each with its own block tables from a KVManager, time them, and fit
`predict.cost.fit_profile` on (BatchShape, seconds). The BatchShape of a plan is the simulator's
own (`SimulatedExecutor.shape`), so a profile predicts exactly what the simulator will ask.

KV transfer cost is measured too: copies of N blocks' worth of bytes between device and host
(pinned host memory on CUDA; on CPU a host-to-host copy, which is what a CPU "swap" costs), once as
one copy and once as N per-block copies, fitted with `fit_transfer` (bytes / bandwidth + per-op
overhead).

`profile_from_traces` fits the same model on step traces of real runs instead (`--from-trace`,
sim/trace_fit.py), with the engine loop's own per-step time as terms of its own.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenslice.sim.profile_options import ProfileOptions
from tokenslice.engine.step_trace import load_step_trace
from tokenslice.sim.trace_fit import fit_steps, grid_measurements, traced_steps
from tokenslice.sim.executor import SimulatedExecutor
from tokenslice.kv.manager import KVManager
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.predict.cost import (PROFILE_FEATURES, BatchShape, ProfileCostModel, TransferSpec, fit_profile,
                                     fit_transfer, nnls, profile_features)
from tokenslice.request import SamplingParams

log = logging.getLogger(__name__)

# Transfer sizes stop at this many bytes per copy: enough to see bandwidth, quick on 2 CPU cores.
MAX_TRANSFER_BYTES = 64 << 20
# KV pool for the grid may use at most this share of the memory available on the device: the
# share the engine's own pool takes by default.
KV_MEMORY_SHARE = CacheConfig.kv_memory_fraction


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


@dataclass
class ProfileReport:
    cost: ProfileCostModel
    samples: list[tuple[BatchShape, float]]
    transfer_samples: list[tuple[int, int, float]]
    elapsed_s: float
    relative_errors: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The profile (loadable by `load_cost_model`) plus the raw measurements behind it."""
        data = self.cost.to_dict()
        data["measurements"] = [{**asdict(shape), "seconds": s} for shape, s in self.samples]
        data["transfer_measurements"] = [{"bytes": b, "ops": o, "seconds": s} for b, o, s in self.transfer_samples]
        data["profiling_seconds"] = self.elapsed_s
        data["median_relative_error"] = float(np.median(self.relative_errors)) if self.relative_errors else None
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(point: GridPoint, kv: KVManager, vocab: int, rng: np.random.Generator, tag: str) -> tuple[StepPlan, list[str]]:
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
        _sync(target.device)
        t0 = time.perf_counter()
        target.execute(plan)
        _sync(target.device)
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
                    _sync(device)
                    t0 = time.perf_counter()
                    if many:
                        for i in range(n):
                            dst[i * elems:(i + 1) * elems].copy_(src[i * elems:(i + 1) * elems], non_blocking=pin)
                    else:
                        dst[:n * elems].copy_(src[:n * elems], non_blocking=pin)
                    _sync(device)
                    if r:
                        times.append(time.perf_counter() - t0)
                out.append((n * elems * 4, n if many else 1, float(np.min(times))))
    return out


def fit_relative(samples: Sequence[tuple[BatchShape, float]], **kwargs: Any) -> ProfileCostModel:
    """`fit_profile`, then refit the coefficients to minimise *relative* error.

    Plain least squares is ruled by the largest steps (a 2k-token prefill is 100x a decode), and
    then predicts ~0 for a lone decode — the step policies and the SLO are built from. Dividing
    each row by its measured time weights every step alike. r^2 stays on the plain scale.
    """
    cost = fit_profile(samples, **kwargs)
    a = np.array([profile_features(shape) for shape, _ in samples])
    y = np.array([s for _, s in samples])
    w = 1.0 / np.maximum(y, 1e-9)
    aw = a * w[:, None]
    norms = np.linalg.norm(aw, axis=0)
    scale = np.where(norms > 0, norms, 1.0)  # same column normalisation as fit_profile
    coef = nnls(aw / scale, np.ones_like(y)) / scale
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - a @ coef) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return ProfileCostModel(coefficients=dict(zip(PROFILE_FEATURES, (float(c) for c in coef))),
                            transfer=cost.transfer, kv_bytes_per_token=cost.kv_bytes_per_token, model=cost.model,
                            device=cost.device, samples=cost.samples, r2=r2, tensor_parallel=cost.tensor_parallel)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return f"cpu-{torch.get_num_threads()}t"


def _max_context(opts: ProfileOptions, limit: int) -> int:
    max_ctx = min(opts.max_context or min(limit, 1024), limit)
    if max_ctx < 17:
        raise ValueError(f"max context {max_ctx} is too short to profile (need at least 17 tokens)")
    return max_ctx


def _grid_blocks(point: GridPoint, block_size: int) -> int:
    return sum(-(-t // block_size) for t in point.total_tokens_per_seq())


def _fit(samples: list[tuple[BatchShape, float]], transfer_samples: list[tuple[int, int, float]],
         kv_bytes_per_token: int, model: str, device: str, tensor_parallel: int
         ) -> tuple[ProfileCostModel, list[float]]:
    """The relative fit of the grid and the transfer link, and the fit's relative errors."""
    try:
        transfer: TransferSpec | list[tuple[int, int, float]] = fit_transfer(transfer_samples)
    except ValueError as e:  # e.g. timer noise swamped every copy on a tiny model
        log.warning("transfer fit failed (%s); using the PCIe gen4 default", e)
        transfer = TransferSpec(25e9, 10e-6)
    cost = fit_relative(samples, kv_bytes_per_token=kv_bytes_per_token, transfer=transfer, model=model,
                        device=device, tensor_parallel=tensor_parallel)
    return cost, [abs(cost.iteration_seconds(shape) - s) / s for shape, s in samples if s > 0]


def run_profile(opts: ProfileOptions, progress: Callable[[int, int], None] | None = None) -> ProfileReport:
    """Load the model, time the grid, measure transfers, fit. `progress(done, total)` per step run.
    With tensor_parallel_size > 1 the model runs sharded over worker processes (_profile_parallel)."""
    from tokenslice.model.loader import load_model
    from tokenslice.model.runner import ModelRunner, available_memory_bytes

    if opts.max_batch_size < 1 or opts.repeats < 1 or opts.max_tokens_per_step < 16:
        raise ValueError("profile needs max_batch_size >= 1, repeats >= 1 and max_tokens_per_step >= 16")
    if opts.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {opts.tensor_parallel_size}")
    start = time.perf_counter()
    if opts.tensor_parallel_size > 1:
        return _profile_parallel(opts, progress, start)
    loaded = load_model(ModelConfig(model=opts.model, dtype=opts.dtype, device=opts.device, seed=opts.seed))
    max_ctx = _max_context(opts, loaded.arch.max_position_embeddings)
    grid = reduce_grid(profile_grid(opts.max_batch_size, max_ctx, opts.max_tokens_per_step), opts.samples)

    bs = opts.block_size
    elem = torch.finfo(loaded.dtype).bits // 8
    block_bytes = bs * loaded.arch.kv_bytes_per_token // 4 * elem  # arch counts 4-byte values
    budget = max(int(available_memory_bytes(loaded.device) * KV_MEMORY_SHARE) // block_bytes, 1)
    kept = [p for p in grid if _grid_blocks(p, bs) <= budget]
    if len(kept) < len(grid):
        log.warning("skipping %d grid points that need more KV than %.0f%% of free memory",
                    len(grid) - len(kept), KV_MEMORY_SHARE * 100)
    if len(kept) < 6:
        raise ValueError("too few grid points fit in memory; lower --max-batch-size or --max-context")
    num_blocks = max(_grid_blocks(p, bs) for p in kept)
    runner = ModelRunner(loaded, num_blocks, bs, opts.seed)
    kv = KVManager(bs, num_blocks)
    rng = np.random.default_rng(opts.seed)

    target = GridTarget(runner.execute, runner.sampler.forget, runner.device)
    samples = time_grid(target, kept, kv, loaded.arch.vocab_size, opts.repeats, rng, progress)
    transfer_samples = measure_transfer(runner.block_bytes, runner.device, repeats=opts.repeats)
    cost, errors = _fit(samples, transfer_samples, runner.block_bytes // bs, Path(loaded.name).name or loaded.name,
                        device_name(runner.device), 1)
    lens = calibration_lengths(opts, max_ctx)
    engine = _local_engine(loaded, opts, sum(-(-(p + o) // bs) for p, o in lens), max_ctx)
    cost = calibrated(cost, engine_calibration(engine, cost, lens, loaded.arch.vocab_size, loaded.device))
    return ProfileReport(cost, samples, transfer_samples, time.perf_counter() - start, errors)


def _profile_parallel(opts: ProfileOptions, progress: Callable[[int, int], None] | None,
                      start: float) -> ProfileReport:
    """`run_profile` on a tensor-parallel engine (Engine.from_config, one worker per rank): the grid
    steps and the calibration burst run on every rank, so their times include the ranks'
    collectives. Copies are timed in this process on rank 0's device for one rank's share of a
    block; the ranks copy their shares at once over their own links, so the fit counts the whole
    block's bytes in that time."""
    from tokenslice.engine.engine import Engine
    from tokenslice.model.loader import load_arch, rank_device, resolve_dtype
    from tokenslice.model.runner import host_block_bytes

    tp = opts.tensor_parallel_size
    model = ModelConfig(model=opts.model, dtype=opts.dtype, device=opts.device, seed=opts.seed)
    arch = load_arch(model)
    max_ctx = _max_context(opts, arch.max_position_embeddings)
    grid = reduce_grid(profile_grid(opts.max_batch_size, max_ctx, opts.max_tokens_per_step), opts.samples)
    lens = calibration_lengths(opts, max_ctx)
    bs = opts.block_size
    blocks = max(max(_grid_blocks(p, bs) for p in grid), sum(-(-(p + o) // bs) for p, o in lens))
    engine = Engine.from_config(EngineConfig(
        model=model, cache=CacheConfig(block_size=bs, kv_cache_blocks=blocks),
        scheduler=SchedulerConfig(policy="fcfs", max_batch_size=opts.max_batch_size,
                                  max_tokens_per_step=opts.max_tokens_per_step),
        parallel=ParallelConfig(tensor_parallel_size=tp)))
    try:
        device = rank_device(opts.device, 0)
        finished: list[str] = []  # forgotten by every rank with the next plan

        def execute(plan: StepPlan) -> Any:
            plan.finished = finished[:]
            finished.clear()
            return engine.executor.execute(plan)

        samples = time_grid(GridTarget(execute, finished.extend, device), grid, KVManager(bs, blocks),
                            arch.vocab_size, opts.repeats, np.random.default_rng(opts.seed), progress)
        block = host_block_bytes(arch, bs, resolve_dtype(opts.dtype, arch, device))
        share = measure_transfer(max(block // tp, 1), device, repeats=opts.repeats)
        transfer_samples = [(b * tp, ops, s) for b, ops, s in share]
        cost, errors = _fit(samples, transfer_samples, block // bs, Path(opts.model).name or opts.model,
                            device_name(device), tp)
        cost = calibrated(cost, engine_calibration(engine, cost, lens, arch.vocab_size, device))
    finally:
        engine.close()
    return ProfileReport(cost, samples, transfer_samples, time.perf_counter() - start, errors)


def calibration_lengths(opts: ProfileOptions, max_ctx: int) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the calibration burst: 4 batches of random lengths."""
    rng = np.random.default_rng(opts.seed + 1)
    return [(int(rng.integers(8, max_ctx // 4)), int(rng.integers(8, max_ctx // 4)))
            for _ in range(4 * opts.max_batch_size)]


def _local_engine(loaded: Any, opts: ProfileOptions, blocks: int, max_ctx: int) -> Any:
    """An fcfs engine around a fresh runner of `loaded` with `blocks` KV blocks."""
    from tokenslice.clock import RealClock
    from tokenslice.engine.engine import Engine
    from tokenslice.exec.local import LocalExecutor
    from tokenslice.model.runner import ModelRunner
    from tokenslice.sched.registry import make_policy
    from tokenslice.sched.scheduler import Scheduler

    bs = opts.block_size
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=opts.max_batch_size,
                          max_tokens_per_step=opts.max_tokens_per_step)
    runner = ModelRunner(loaded, blocks, bs, opts.seed)
    return Engine(Scheduler(cfg, make_policy("fcfs"), KVManager(bs, blocks)), LocalExecutor(runner),
                  tokenizer=loaded.tokenizer, clock=RealClock(), max_model_len=max_ctx,
                  vocab_size=loaded.arch.vocab_size, eos_token_ids=[])


def engine_calibration(eng: Any, cost: ProfileCostModel, lens: Sequence[tuple[int, int]], vocab: int,
                       device: torch.device) -> dict[str, float]:
    """Calibrate the grid fit against the serving loop: a forward-pass scale, and the loop's own
    per-step work (scheduling, bookkeeping, detokenization) as a + b * sequences in the step.

    Grid points are timed in isolation and repeated, so caches are warm; the serving loop
    interleaves its own work with every forward pass. Without this the simulator ran ~30% fast
    and under-predicted queueing near saturation. The run is a synthetic burst (`lens`: prompt
    and output tokens per request), fcfs, through the full Engine `eng`.
    """
    rng = np.random.default_rng(len(lens))
    steps: list[tuple[float, float, int]] = []  # (predicted forward, measured forward, sequences)
    execute = eng.executor.execute

    def timed(plan: Any) -> Any:
        t = time.perf_counter()
        out = execute(plan)
        _sync(device)
        steps.append((cost.iteration_seconds(SimulatedExecutor.shape(plan)), time.perf_counter() - t,
                      len(plan.prefill) + len(plan.decode)))
        return out

    eng.executor.execute = timed  # type: ignore[method-assign]
    for i, (p, o) in enumerate(lens):
        ids = [int(x) for x in rng.integers(0, vocab, size=p)]
        eng.add_request(ids, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True), request_id=f"cal{i}")
    walls = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    eng.executor.execute = execute  # type: ignore[method-assign]
    pred, fwd, seqs = (np.array(x, dtype=float) for x in zip(*steps, strict=True))
    scale = float(fwd.sum() / pred.sum()) if pred.sum() > 0 else 1.0
    overhead = np.array(walls) - fwd
    a, b = nnls(np.stack([np.ones_like(seqs), seqs], axis=1), overhead)
    return {"forward_scale": scale, "step_overhead_s": float(a), "step_overhead_per_seq_s": float(b)}


def calibrated(cost: ProfileCostModel, cal: dict[str, float]) -> ProfileCostModel:
    data = cost.to_dict()
    coef = {k: v * cal["forward_scale"] for k, v in data["coefficients"].items()}
    coef["base"] += cal["step_overhead_s"]
    coef["prefill_seqs"] += cal["step_overhead_per_seq_s"]
    coef["decode_seqs"] += cal["step_overhead_per_seq_s"]
    data["coefficients"] = coef
    return ProfileCostModel.from_dict(data)


def profile_from_traces(opts: ProfileOptions, traces: Sequence[str | Path]) -> ProfileCostModel:
    """A profile fitted on step traces the engine recorded running `opts.model` (sim/trace_fit.py).
    The model's architecture, dtype and block size give the bytes a KV block moves; the host link
    is measured here unless the traces hold enough synchronous swaps to fit it on."""
    from tokenslice.model.loader import load_arch, resolve_device, resolve_dtype
    from tokenslice.model.runner import host_block_bytes

    if not traces:
        raise ValueError("no step traces to fit on")
    arch = load_arch(ModelConfig(model=opts.model, dtype=opts.dtype, device=opts.device))
    device = resolve_device(opts.device)
    block = host_block_bytes(arch, opts.block_size, resolve_dtype(opts.dtype, arch, device))
    steps = [s for path in traces for s in traced_steps(load_step_trace(path))]
    grid = grid_measurements(opts.with_grid) if opts.with_grid else []
    try:
        transfer = fit_transfer(measure_transfer(block, device, repeats=opts.repeats))
    except ValueError:  # timer noise swamped the copies
        transfer = TransferSpec(25e9, 10e-6)
    return fit_steps(steps, kv_bytes_per_token=block // opts.block_size, block_bytes=block, transfer=transfer,
                     model=Path(opts.model).name or opts.model, device=device_name(device),
                     tensor_parallel=opts.tensor_parallel_size, match_total=opts.match_total, grid=grid)


def describe(report: ProfileReport) -> str:
    """Human summary: fit quality, coefficients, key predictions, transfer link."""
    c = report.cost
    sharded = f" over {c.tensor_parallel} tensor-parallel ranks" if c.tensor_parallel > 1 else ""
    lines = [f"profile of {c.model} on {c.device}{sharded}: {c.samples} steps in {report.elapsed_s:.1f} s, "
             f"r^2 = {c.r2:.4f}" + (f", median relative error {np.median(report.relative_errors):.1%}"
                                    if report.relative_errors else "")]
    lines += [f"  {k:<16} {v:.4g}" + (" s" if k == "base" else " s/unit") for k, v in c.coefficients.items()]
    lines.append(f"  decode (1 seq, short context): {c.min_iteration_seconds() * 1e3:.3f} ms; "
                 f"prefill 512 tokens: {c.first_iteration_seconds(512) * 1e3:.3f} ms")
    t = c.transfer
    bw = t.bytes_per_s / 1e9 if math.isfinite(t.bytes_per_s) else math.inf
    lines.append(f"  KV transfer: {bw:.3g} GB/s + {t.op_overhead_s * 1e6:.3g} us per copy; "
                 f"{c.kv_bytes_per_token} KV bytes per token")
    if c.r2 is not None and c.r2 < 0.9:
        lines.append("  warning: r^2 < 0.9, the linear model fits this machine poorly (noisy timer? "
                     "try more --repeats)")
    return "\n".join(lines)


__all__ = ["GridPoint", "GridTarget", "ProfileReport", "profile_grid", "reduce_grid", "calibration_lengths",
           "time_point", "time_grid", "measure_transfer", "fit_relative", "device_name", "run_profile",
           "profile_from_traces", "describe"]
