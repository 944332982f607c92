"""First-come-first-served, at iteration level (Orca / vLLM) and at request level
(FasterTransformer)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy, PolicyContext


class FCFSPolicy(LiveSetPolicy):
    """Oldest request first; a started request runs to completion unless memory forces it out."""

    name = "fcfs"

    def ranked(self, now: float) -> Iterable[Request]:
        return self._live.values()


class RequestLevelPolicy(FCFSPolicy):
    """A batch is formed from the oldest requests and runs until every member finishes; only
    then may new requests join (FasterTransformer's static batching)."""

    name = "request-level"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__()
        self.batch_size = ctx.max_batch_size
        self._batch: dict[str, Request] = {}

    def on_finish(self, req: Request) -> None:
        super().on_finish(req)
        self._batch.pop(req.request_id, None)

    def describe_queues(self) -> dict[str, Any]:
        """The static batch, then the queue that waits for all of it to finish."""
        return {"kind": "request-level", "batch": list(self._batch),
                "order": [rid for rid in self._live if rid not in self._batch]}

    def ranked(self, now: float) -> Iterable[Request]:
        if not self._batch:
            for rid, r in self._live.items():
                if len(self._batch) >= self.batch_size:
                    break
                self._batch[rid] = r
        return self._batch.values()
