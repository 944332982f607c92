"""Clocks: the engine asks a clock for `now`, so the simulator can swap in virtual time."""
from __future__ import annotations

import time


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        """Real time advances by itself; executors that really ran need not report it."""


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
