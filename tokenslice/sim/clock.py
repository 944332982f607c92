"""The simulator's clock: virtual time that moves only when the simulator says so."""
from __future__ import annotations


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
