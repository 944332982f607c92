"""The engine asks a clock for `now`, so the simulator can swap in virtual time (sim/clock.py)."""
from __future__ import annotations

import time


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        """Real time advances by itself; executors that really ran need not report it."""
