"""Shortest remaining processing time. `srpt-oracle` knows each request's true output length
(the bound every other policy is compared with)."""
from __future__ import annotations

from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy, PolicyContext, queue_position_estimates


class SRPTOraclePolicy(LiveSetPolicy):
    """Running jobs only get shorter, so a batch stays on top until an arrival or a finish."""

    name = "srpt-oracle"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__()
        self.ctx = ctx

    def remaining_tokens(self, req: Request) -> int:
        total = req.expected_output_tokens if req.expected_output_tokens is not None else req.params.max_tokens
        return max(0, min(total, req.params.max_tokens) - req.num_output_tokens)

    def remaining_s(self, req: Request) -> float:
        """Remaining execution time: any prefill still owed plus the remaining decode steps."""
        prefill = self.ctx.first_iteration_s(req.remaining_tokens) if req.remaining_tokens > 1 else 0.0
        return prefill + self.remaining_tokens(req) * self.ctx.decode_s(req.num_tokens)

    def ranked(self, now: float) -> list[Request]:
        # Remaining output tokens first (what SRPT orders by), prompt work and arrival break ties.
        return sorted(self._live.values(),
                      key=lambda r: (self.remaining_tokens(r), r.remaining_tokens, r.arrival_time))

    def next_run_estimate(self, req: Request, now: float) -> float:
        ranked = self.ranked(now)
        rem = {r.request_id: self.remaining_s(r) for r in ranked}
        return queue_position_estimates(ranked, rem, self.ctx.max_batch_size).get(req.request_id, 0.0)
