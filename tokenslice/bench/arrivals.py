"""When requests arrive: Poisson, Gamma with a given coefficient of variation (bursty, CV > 1), or
all at once (docs/DESIGN.md, "Benchmark protocols"). No torch here.
"""
from __future__ import annotations

import math

import numpy as np

def arrival_times(n: int, rate: float | None, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of n requests, the first at 0.

    rate None or inf: all at once (a closed-loop client then limits concurrency). Otherwise gaps
    are Gamma with mean 1/rate and coefficient of variation cv: shape 1/cv^2, scale 1/(rate*shape).
    cv = 1 is exactly Poisson (Gamma of shape 1 is the exponential, drawn the same way); cv = 0 is
    evenly spaced; cv > 1 is bursty (the steady-state protocol uses cv = 4).
    """
    if n <= 0:
        return np.zeros(0)
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"rate must be positive (or None for all at once), got {rate}")
    if cv < 0:
        raise ValueError(f"cv must be >= 0, got {cv}")
    if cv == 0:
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        shape = 1.0 / cv ** 2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


__all__ = ["arrival_times"]
