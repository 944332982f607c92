"""`fixed-priority`: FastServe's baseline that orders by input length only."""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy


class FixedPriorityPolicy(LiveSetPolicy):
    """Shorter input first, fixed for the job's life (FastServe's fixed-priority baseline)."""

    name = "fixed-priority"

    def __init__(self) -> None:
        super().__init__()
        self._keys: list[tuple[int, float, int, str]] = []  # sorted: the ranking
        self._order = itertools.count()
        self._key_of: dict[str, tuple[int, float, int, str]] = {}

    def on_arrival(self, req: Request, now: float) -> None:
        super().on_arrival(req, now)
        key = (req.num_prompt_tokens, req.arrival_time, next(self._order), req.request_id)
        bisect.insort(self._keys, key)
        self._key_of[req.request_id] = key

    def on_finish(self, req: Request) -> None:
        super().on_finish(req)
        key = self._key_of.pop(req.request_id, None)
        if key is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]

    def ranked(self, now: float) -> Iterable[Request]:
        return (self._live[k[3]] for k in self._keys)
