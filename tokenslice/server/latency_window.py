"""Latency samples of the last minute (TTFT, TBT) for the live view's percentiles; Prometheus
histograms keep totals since start, which cannot say what the last minute looked like."""
from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 60.0
# A bound on memory at high token rates: past it the oldest samples go first (the window shrinks).
MAX_SAMPLES = 50_000
QUANTILES = (0.5, 0.9, 0.99)


class LatencyWindow:
    """Samples (seconds) observed in the last `window_s` seconds of the monotonic clock."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        self._samples.append((time.monotonic(), value))

    def _trim(self) -> None:
        start = time.monotonic() - self.window_s
        while self._samples and self._samples[0][0] < start:
            self._samples.popleft()

    def summary(self) -> dict[str, float | int | None]:
        """{"count", "p50", "p90", "p99"} over the window (nearest-rank percentiles; None when empty)."""
        self._trim()
        # list() copies in one C call: safe while the engine thread appends (--no-engine-process).
        values = sorted(v for _, v in list(self._samples))
        out: dict[str, float | int | None] = {"count": len(values)}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = values[max(0, math.ceil(q * len(values)) - 1)] if values else None
        return out


__all__ = ["LatencyWindow", "WINDOW_S"]
