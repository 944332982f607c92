"""Sync or async swap-in, chosen from measured swap statistics (FastSwitch §3.2).

A sync swap-in runs before the step's compute: the loaded request runs this step, but every
request of the batch waits for the copy. An async one overlaps the compute: the batch does not
wait, and the loaded request runs next step. `SwapInChoice` keeps moving averages of the
seconds per copied block and of a step's compute, and picks async when the copy would cost
the batch more than a share of a step (SchedulerConfig.swap_in, swap_in_async_fraction).
"""
from __future__ import annotations

from dataclasses import dataclass

# A new measurement's weight in the moving averages: copies and steps follow the load (batch
# size, link contention) within a few steps, one outlier moves them by a fifth.
EMA_WEIGHT = 0.2


def prefer_async(copy_seconds: float, step_seconds: float, fraction: float) -> bool:
    """Async when the copy's expected time exceeds `fraction` of the expected step: then the
    batch would lose more waiting for it than the request loses by running a step later."""
    return copy_seconds > fraction * step_seconds


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


@dataclass
class SwapInChoice:
    """One preemption strategy's swap-in choice: `setting` is SchedulerConfig.swap_in,
    `mode_async` its mode's own choice ("mode", and "adaptive" before any measurement)."""

    setting: str
    fraction: float
    mode_async: bool
    block_seconds: float | None = None  # moving average: seconds per copied block
    step_seconds: float | None = None  # moving average: a step's compute, copies excluded

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self.block_seconds = _ema(self.block_seconds, seconds / num_blocks)

    def observe_step(self, compute_seconds: float) -> None:
        if compute_seconds > 0:
            self.step_seconds = _ema(self.step_seconds, compute_seconds)

    def is_async(self, num_blocks: int, model_copy_seconds: float | None = None) -> bool:
        """Whether a swap-in of `num_blocks` blocks overlaps compute. Before the first measured
        copy "adaptive" estimates it with the cost model (`model_copy_seconds`), before the
        first measured step it does as the mode does."""
        if self.setting in ("sync", "async"):
            return self.setting == "async"
        if self.setting == "mode":
            return self.mode_async
        copy_s = self.block_seconds * num_blocks if self.block_seconds is not None else model_copy_seconds
        if copy_s is None or self.step_seconds is None:
            return self.mode_async
        return prefer_async(copy_s, self.step_seconds, self.fraction)
