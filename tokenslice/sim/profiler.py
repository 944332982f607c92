"""`tokenslice profile`: measure the real model on this machine and fit the linear cost model.

ALISE §3.1 models an iteration's time as linear in the batch's token counts. We run a grid of real
steps through the engine's ModelRunner — lone and batched prefills of several lengths, chunked
prefills over a cached prefix, decodes at several batch sizes and context lengths, and a few mixed
batches — each with its own block tables from a KVManager, time them (sim/profile_timing.py), and
fit `predict.fit.fit_relative` on (BatchShape, seconds). The BatchShape of a plan is the simulator's
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
from tokenslice.sim.profile_timing import (GridTarget, grid_blocks, measure_transfer, profile_grid, reduce_grid,
                                           sync_device, time_grid)
from tokenslice.kv.manager import KVManager
from tokenslice.plan import StepPlan
from tokenslice.predict.cost import BatchShape, TransferSpec
from tokenslice.predict.fit import fit_relative, fit_transfer, nnls
from tokenslice.predict.profile import ProfileCostModel
from tokenslice.request import SamplingParams

log = logging.getLogger(__name__)

# KV pool for the grid may use at most this share of the memory available on the device now
# (the grid's largest point sizes the pool; a point past it is skipped, not an error).
KV_MEMORY_SHARE = 0.25


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


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return f"cpu-{torch.get_num_threads()}t"


def _max_context(opts: ProfileOptions, limit: int) -> int:
    max_ctx = min(opts.max_context or min(limit, 1024), limit)
    if max_ctx < 17:
        raise ValueError(f"max context {max_ctx} is too short to profile (need at least 17 tokens)")
    return max_ctx


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
    from tokenslice.model.kv_pool import available_memory_bytes
    from tokenslice.model.runner import ModelRunner

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
    kept = [p for p in grid if grid_blocks(p, bs) <= budget]
    if len(kept) < len(grid):
        log.warning("skipping %d grid points that need more KV than %.0f%% of free memory",
                    len(grid) - len(kept), KV_MEMORY_SHARE * 100)
    if len(kept) < 6:
        raise ValueError("too few grid points fit in memory; lower --max-batch-size or --max-context")
    num_blocks = max(grid_blocks(p, bs) for p in kept)
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
    blocks = max(max(grid_blocks(p, bs) for p in grid), sum(-(-(p + o) // bs) for p, o in lens))
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
        sync_device(device)
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


__all__ = ["ProfileReport", "calibration_lengths", "device_name", "run_profile", "profile_from_traces",
           "describe"]
