"""Synthetic token lengths and the input:output rescaling of a workload (docs/DESIGN.md,
"Benchmark protocols"): fixed, Zipf(theta) over a range, or log-normal, each capped.
No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; samples are integers in [min_len, max_len].

    kind "fixed": always `value`. "zipf": P(min_len + k - 1) proportional to k^-theta for rank
    k = 1..(max_len - min_len + 1), heavy-tailed like real outputs (FastServe's synthetic
    workloads). "lognormal": mean `value` with log-space std `sigma` (mu = ln value - sigma^2/2).
    """

    kind: str = "fixed"
    value: float = 128.0
    theta: float = 1.5
    sigma: float = 1.0
    min_len: int = 1
    max_len: int = 2048

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.min_len < 1 or self.max_len < self.min_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.kind == "fixed":
            out = np.full(n, round(self.value), dtype=np.int64)
        elif self.kind == "zipf":
            ranks = np.arange(1, self.max_len - self.min_len + 2, dtype=float)
            p = ranks ** -self.theta
            out = self.min_len - 1 + rng.choice(ranks.astype(np.int64), size=n, p=p / p.sum())
        elif self.kind == "lognormal":
            if self.value <= 0 or self.sigma < 0:
                raise ValueError(f"lognormal needs value > 0 and sigma >= 0, got {self.value}, {self.sigma}")
            mu = math.log(self.value) - self.sigma ** 2 / 2
            out = np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}; expected fixed, zipf or lognormal")
        return np.clip(out, self.min_len, self.max_len)


def scale_io_ratio(prompt_lens: np.ndarray, output_lens: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Rescale lengths so mean(input) / mean(output) = ratio with mean(input + output) unchanged.

    Rule (FastServe Fig. 14 varies the input:output ratio at constant total work): with means I, O
    and T = I + O, inputs are multiplied by a = T*R / ((1+R)*I) and outputs by b = T / ((1+R)*O),
    then rounded, each at least 1. Each side keeps its distribution's shape; only its scale moves.
    """
    if ratio <= 0:
        raise ValueError(f"io_ratio must be positive, got {ratio}")
    p = np.asarray(prompt_lens, dtype=float)
    o = np.asarray(output_lens, dtype=float)
    if len(p) == 0:
        return p.astype(np.int64), o.astype(np.int64)
    mean_in, mean_out = p.mean(), o.mean()
    total = mean_in + mean_out
    a = total * ratio / ((1 + ratio) * mean_in)
    b = total / ((1 + ratio) * mean_out)
    return (np.maximum(np.rint(p * a), 1).astype(np.int64), np.maximum(np.rint(o * b), 1).astype(np.int64))


__all__ = ["LengthDist", "scale_io_ratio"]
