"""`fixed-priority`: FastServe's baseline that orders by input length only."""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy, SortedKeys


class FixedPriorityPolicy(LiveSetPolicy):
    """Shorter input first, fixed for the job's life (FastServe's fixed-priority baseline)."""

    name = "fixed-priority"

    def __init__(self) -> None:
        super().__init__()
        self._keys = SortedKeys()  # (prompt tokens, arrival, order, id): the ranking
        self._order = itertools.count()

    def on_arrival(self, req: Request, now: float) -> None:
        super().on_arrival(req, now)
        self._keys.put(req.request_id, (req.num_prompt_tokens, req.arrival_time, next(self._order), req.request_id))

    def on_finish(self, req: Request) -> None:
        super().on_finish(req)
        self._keys.pop(req.request_id)

    def ranked(self, now: float) -> Iterable[Request]:
        return (self._live[k[3]] for k in self._keys)

    def describe_queues(self) -> dict[str, Any]:
        return {"kind": "sorted", "key": "prompt_tokens",
                "order": [{"id": k[3], "prompt_tokens": k[0]} for k in self._keys]}
