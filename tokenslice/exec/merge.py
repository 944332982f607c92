"""One StepResult out of every rank's answer to the same plan (exec/multiproc.py and
exec/ray_executor.py): rank 0's sampled tokens, the slowest rank's times, and an async transfer
reported done only once every rank has finished its part of it, so the scheduler never reuses
blocks some rank is still copying (FastServe §4.3)."""
from __future__ import annotations

from tokenslice.plan import StepResult


class RankMerger:
    """Remembers, across steps, which ranks finished each request's async transfer."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._transfer_ranks: dict[str, int] = {}  # request -> ranks that reported its copy done
        self._transfer_seconds: dict[str, float] = {}  # request -> the longest of those copies

    def merge(self, results: list[StepResult]) -> StepResult:
        """`results`: one per rank, rank 0 first."""
        merged = results[0]
        done: list[str] = []
        for r in results:
            for rid in r.transfers_done:
                self._transfer_ranks[rid] = self._transfer_ranks.get(rid, 0) + 1
                seconds = r.transfer_durations.get(rid)
                if seconds is not None:
                    self._transfer_seconds[rid] = max(seconds, self._transfer_seconds.get(rid, 0.0))
                if self._transfer_ranks[rid] == self.size:
                    done.append(rid)
        merged.transfers_done = done
        merged.transfer_durations = {rid: self._transfer_seconds.pop(rid) for rid in done
                                     if rid in self._transfer_seconds}
        for rid in done:
            del self._transfer_ranks[rid]
        merged.step_seconds = max(r.step_seconds for r in results)
        merged.transfer_seconds = max(r.transfer_seconds for r in results)
        return merged
