"""One StepResult out of every rank's answer to the same plan (exec/multiproc.py and
exec/ray_executor.py): the answering rank's sampled tokens (the last pipeline stage's first),
each stage's slowest rank's times, and an async transfer reported done only once every rank has
finished its part of it, so the scheduler never reuses blocks some rank is still copying
(FastServe §4.3)."""
from __future__ import annotations

from tokenslice.plan import StepResult


class RankMerger:
    """Remembers, across steps, which ranks finished each request's async transfer, and sums each
    pipeline stage's work and waits (`stage_busy_s` / `stage_wait_s`: the pipeline's bubbles, for
    benchmarks and the simulator's cost model)."""

    def __init__(self, tp_size: int, pp_size: int = 1) -> None:
        self.tp_size, self.pp_size = tp_size, pp_size
        self.size = tp_size * pp_size
        self.stage_busy_s = [0.0] * pp_size
        self.stage_wait_s = [0.0] * pp_size
        self._transfer_ranks: dict[str, int] = {}  # request -> ranks that reported its copy done
        self._transfer_seconds: dict[str, float] = {}  # request -> the longest of those copies

    def merge(self, results: list[StepResult]) -> StepResult:
        """`results`: one per rank, in rank order (stage-major). The merged `step_seconds` is the
        plan's time through the pipe: the sum over stages of the slowest rank's work, waits for
        neighbours left out."""
        merged = results[self.size - self.tp_size]  # the last stage's first rank sampled the answer
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
        tp, step, sync = self.tp_size, 0.0, 0.0
        for i in range(self.pp_size):
            stage = results[i * tp:(i + 1) * tp]
            busy = max(r.step_seconds - r.wait_seconds for r in stage)
            self.stage_busy_s[i] += busy
            self.stage_wait_s[i] += max(r.wait_seconds for r in stage)
            step += busy
            sync += max(r.transfer_seconds for r in stage)
        merged.step_seconds, merged.transfer_seconds, merged.wait_seconds = step, sync, 0.0
        return merged
