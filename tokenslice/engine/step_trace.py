"""Step traces: one JSON line per real engine step (batch composition, queue sizes, swap work,
the loop's own time split), for fitting and checking the simulator's cost model against what
the engine really did. Written only when `--step-trace FILE` is set."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec

from tokenslice.plan import StepPlan, StepResult, copy_runs


@dataclass
class StepRecord:
    step: int  # engine step number, from 1
    start: float  # wall clock (Unix seconds) when scheduling began
    # Per prefill slice: [chunk tokens, context tokens already cached before it].
    prefill: list[list[int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)  # per decode slice: context length, new token included
    sampled: int = 0  # tokens produced
    running: int = 0  # requests by state after scheduling
    waiting: int = 0
    preempted: int = 0
    swap_out_blocks: int = 0  # synchronous, before compute
    swap_out_runs: int = 0  # contiguous copies they coalesce into
    swap_in_blocks: int = 0
    swap_in_runs: int = 0
    async_started: int = 0  # background transfers started by this plan
    async_blocks: int = 0
    async_done: int = 0  # background transfers reported complete
    dropped: int = 0  # requests whose KV was discarded (recompute)
    finished: int = 0  # requests the step finished; none left live means the engine idles next
    schedule_s: float = 0.0  # the loop's own time split (perf counter)
    execute_s: float = 0.0
    update_s: float = 0.0
    step_seconds: float = 0.0  # StepResult: the executor's step, synchronous copies included
    transfer_seconds: float = 0.0
    prefill_ids: list[str] = field(default_factory=list)  # the request of each prefill slice, in order


def step_record(step: int, start: float, plan: StepPlan, result: StepResult, counts: tuple[int, int, int],
                times: tuple[float, float, float], finished: int = 0) -> StepRecord:
    """The record of one step from its plan and result; `counts` are (running, waiting,
    preempted) after scheduling, `times` (schedule, execute, update) seconds and `finished`
    the requests the step's update finished."""
    return StepRecord(
        step, start,
        prefill=[[s.num_tokens, s.start_pos] for s in plan.prefill],
        decode=[s.start_pos + s.num_tokens for s in plan.decode],
        sampled=len(result.sampled),
        running=counts[0], waiting=counts[1], preempted=counts[2],
        swap_out_blocks=len(plan.swap_out), swap_out_runs=len(copy_runs(plan.swap_out)),
        swap_in_blocks=len(plan.swap_in), swap_in_runs=len(copy_runs(plan.swap_in)),
        async_started=len(plan.async_transfers), async_blocks=sum(len(t.pairs) for t in plan.async_transfers),
        async_done=len(result.transfers_done), dropped=len(plan.drop), finished=finished,
        schedule_s=times[0], execute_s=times[1], update_s=times[2],
        step_seconds=result.step_seconds, transfer_seconds=result.transfer_seconds,
        prefill_ids=[s.request_id for s in plan.prefill])


class StepTraceWriter:
    """Appends records to a JSON-lines file, flushed per step so a killed process keeps its trace."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[bytes] | None = open(path, "ab")
        self._encode = msgspec.json.Encoder().encode  # ~2 us a record: tracing barely slows the loop it measures

    def write(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(self._encode(record) + b"\n")
            self._file.flush()

    def wall_start(self, perf_start: float) -> float:
        """Wall-clock time of a perf_counter reading taken moments ago."""
        return time.time() - (time.perf_counter() - perf_start)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def load_step_trace(path: str | Path) -> list[StepRecord]:
    """Read a trace written by StepTraceWriter, in step order."""
    with open(path, encoding="utf-8") as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]
