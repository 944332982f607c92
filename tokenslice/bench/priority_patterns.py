"""Priority patterns (FastSwitch §4): `PriorityPattern` / `PriorityUpdates` give every request an
initial priority level at arrival and new levels for the live requests every 1/f iterations.
No torch here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PRIORITY_PATTERNS = ("random", "markov")
# FastSwitch §4 varies priorities among discrete levels; the level count is not stated in the
# paper's text we could find, so 8 levels is our choice.
DEFAULT_PRIORITY_LEVELS = 8
# Markov pattern: a level stays with this probability, else moves one level up or down.
DEFAULT_MARKOV_STAY = 0.5


@dataclass(frozen=True)
class PriorityPattern:
    """How priorities change during a run (FastSwitch §4, "Random" and "Markov" patterns).

    Levels are integers in [0, levels). Every `period` = round(1 / update_freq) iterations (engine
    steps) the levels of all live requests are recomputed: update_freq 0.01 is every 100 steps.

    - random: each live request draws an independent uniform level.
    - markov: each request's level follows a chain: stay with probability `markov_stay`, else up
      or down one level with equal probability; a move past either end stays put. The matrix is
      symmetric, hence doubly stochastic, so the uniform distribution is stationary: initial
      levels are uniform in both patterns and the marginals never drift.
    """

    kind: str = "random"
    update_freq: float = 0.01
    levels: int = DEFAULT_PRIORITY_LEVELS
    seed: int = 0
    markov_stay: float = DEFAULT_MARKOV_STAY

    def validate(self) -> None:
        if self.kind not in PRIORITY_PATTERNS:
            raise ValueError(f"unknown priority pattern {self.kind!r}; choose from {', '.join(PRIORITY_PATTERNS)}")
        if not 0 < self.update_freq <= 1:
            raise ValueError(f"priority update frequency must be in (0, 1], got {self.update_freq}")
        if self.levels < 1:
            raise ValueError(f"priority levels must be >= 1, got {self.levels}")
        if not 0 <= self.markov_stay <= 1:
            raise ValueError(f"markov stay probability must be in [0, 1], got {self.markov_stay}")

    @property
    def period(self) -> int:
        """Iterations between update points."""
        return max(1, round(1 / self.update_freq))

    def describe(self) -> dict[str, Any]:
        """The results-file form (`workload` dict)."""
        return {"priority_pattern": self.kind, "priority_update_freq": self.update_freq,
                "priority_levels": self.levels, "priority_seed": self.seed, "markov_stay": self.markov_stay}


class PriorityUpdates:
    """A seeded stream of priority levels for one run (engine.PriorityUpdates).

    `initial` and `at_iteration` draw from two independent streams of the seed, so the levels
    depend only on the sequence of calls: the same trace on the same engine gives the same levels.
    """

    def __init__(self, pattern: PriorityPattern) -> None:
        pattern.validate()
        self.pattern = pattern
        self.period = pattern.period
        init_seq, update_seq = np.random.SeedSequence(pattern.seed).spawn(2)
        self._init_rng = np.random.default_rng(init_seq)
        self._update_rng = np.random.default_rng(update_seq)
        self._level: dict[str, int] = {}  # each live request's current level (the Markov state)

    def initial(self, request: Any) -> int:
        """The level of a request at arrival (anything with a `request_id`)."""
        level = int(self._init_rng.integers(self.pattern.levels))
        self._level[request.request_id] = level
        return level

    def at_iteration(self, iteration: int, live_request_ids: Sequence[str]) -> dict[str, int]:
        """New levels for every live request at an update point (in the order given)."""
        live = list(live_request_ids)
        levels = self.pattern.levels
        if self.pattern.kind == "random":
            new = self._update_rng.integers(levels, size=len(live))
        else:
            # A request never seen (its arrival went elsewhere) starts from the stationary (uniform) law.
            cur = np.array([self._level[rid] if rid in self._level else self._update_rng.integers(levels)
                            for rid in live], dtype=np.int64)
            u = self._update_rng.random(len(live))
            move = (1 - self.pattern.markov_stay) / 2
            step = np.where(u < move, -1, np.where(u < 2 * move, 1, 0))
            nxt = cur + step
            new = np.where((nxt < 0) | (nxt >= levels), cur, nxt)  # a move past an end stays put
        self._level = {rid: int(v) for rid, v in zip(live, new, strict=True)}  # finished requests drop out
        return dict(self._level)


__all__ = ["PRIORITY_PATTERNS", "DEFAULT_PRIORITY_LEVELS", "DEFAULT_MARKOV_STAY", "PriorityPattern",
           "PriorityUpdates"]
