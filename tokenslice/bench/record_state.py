"""`tokenslice simulate --record-state FILE`: the scheduler's state (sched/snapshot.py) as JSON
lines on the simulator's virtual clock, at most one line every `interval_s` simulated seconds per
run, each labelled with its run (policy, rate, load, seed)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tokenslice.sched.scheduler import Scheduler
from tokenslice.sched.snapshot import snapshot


class StateRecorder:
    """Writes snapshots to one file for every run of a sweep (`start_run` labels the next)."""

    def __init__(self, path: str | Path, interval_s: float) -> None:
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"record-state interval must be a positive number of seconds, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.lines = 0
        self._file: IO[str] = self.path.open("w")
        self._run: dict[str, Any] = {}
        self._next = -math.inf  # virtual time of the next snapshot due

    def start_run(self, **labels: Any) -> None:
        """Snapshots from now on belong to the run these labels name; the first is due at once."""
        self._run = labels
        self._next = -math.inf

    def observe(self, scheduler: Scheduler, now: float) -> None:
        """Called after every engine advance: writes a snapshot when one is due."""
        if now < self._next:
            return
        self._file.write(json.dumps({"run": self._run, **snapshot(scheduler, now)}) + "\n")
        self.lines += 1
        self._next = now + self.interval_s

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StateRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["StateRecorder"]
