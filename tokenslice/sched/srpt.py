"""Shortest remaining processing time. `srpt-oracle` knows each request's true output length
(the bound every other policy is compared with)."""
from __future__ import annotations

from typing import Any

from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy, PolicyContext


class SRPTOraclePolicy(LiveSetPolicy):
    """Running jobs only get shorter, so a batch stays on top until an arrival or a finish."""

    name = "srpt-oracle"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__()
        self.ctx = ctx

    def remaining_output_tokens(self, req: Request) -> int:
        total = req.expected_output_tokens if req.expected_output_tokens is not None else req.params.max_tokens
        return max(0, min(total, req.params.max_tokens) - req.num_output_tokens)

    def ranked(self, now: float) -> list[Request]:
        # Remaining output tokens first (what SRPT orders by), prompt work and arrival break ties.
        return sorted(self._live.values(),
                      key=lambda r: (self.remaining_output_tokens(r), r.num_uncomputed_tokens, r.arrival_time))

    def describe_queues(self) -> dict[str, Any]:
        return {"kind": "sorted", "key": "remaining_output_tokens",
                "order": [{"id": r.request_id, "remaining_output_tokens": self.remaining_output_tokens(r)}
                          for r in self.ranked(0.0)]}
