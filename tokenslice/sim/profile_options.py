"""What `tokenslice profile` measures (sim/profiler.py), kept free of torch so the CLI can
read its defaults without loading it."""
from __future__ import annotations

from dataclasses import dataclass

from tokenslice.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, field_from

# The grid's largest decode batch (it times powers of two up to it) and the calibration burst's
# batch: 32, not serve's SchedulerConfig.max_batch_size, keeps a profile on CPU short; the fitted
# model is linear in the batch's token and sequence counts, so it predicts larger batches too.
PROFILE_MAX_BATCH_SIZE = 32


@dataclass
class ProfileOptions:
    """What `tokenslice profile` measures (its flags map one to one onto these fields); a field
    named like a config field is that setting, with its default unless noted."""

    model: str = field_from(ModelConfig, "model")
    dtype: str = field_from(ModelConfig, "dtype")
    device: str = field_from(ModelConfig, "device")
    max_batch_size: int = field_from(SchedulerConfig, "max_batch_size", default=PROFILE_MAX_BATCH_SIZE)
    max_context: int | None = None  # default: the model's context, at most 1024
    max_tokens_per_step: int = field_from(SchedulerConfig, "max_tokens_per_step")
    samples: int | None = None  # grid points kept (evenly over the grid); None: all
    repeats: int = 5  # timed runs per point; the median is kept
    block_size: int = field_from(CacheConfig, "block_size")
    seed: int = field_from(ModelConfig, "seed")
    # GPUs the measured engine shards the model over; the profile records it (its name shows :tpN).
    tensor_parallel_size: int = field_from(ParallelConfig, "tensor_parallel_size")
    # Fitting on step traces: scale the fit so the traced steps add up to their wall time (the
    # engine's throughput, stalls included); off: the typical step.
    match_total: bool = True
    # Fitting on step traces: a grid profile (JSON) whose timed batches join the forward fit.
    with_grid: str | None = None


__all__ = ["PROFILE_MAX_BATCH_SIZE", "ProfileOptions"]
