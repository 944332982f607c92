"""SimulatedExecutor: runs no model; each step costs what the CostModel says (DESIGN.md).

Sampled tokens are a placeholder id: simulated requests end by their max_tokens (the
trace's output length), as serving papers replay datasets.
"""
from __future__ import annotations

from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import BatchShape, CostModel
from tokenslice.request import Request

PLACEHOLDER_TOKEN = 0


class SimulatedExecutor:
    token = PLACEHOLDER_TOKEN

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def repeat_decode_times(self, reqs: list[Request], k: int, now: float,
                            first_step: int = 0) -> tuple[list[float], list[float]]:
        """Durations and end times of decode steps first_step .. first_step + k - 1 of this batch,
        starting at `now`; contexts grow by one a step. Ends accumulate one by one, as the clock
        would step by step."""
        n = len(reqs)
        ctx = sum(r.num_tokens for r in reqs)
        durations, ends = [], []
        t = now
        for j in range(first_step, first_step + k):
            d = self.cost.iteration_seconds(BatchShape(decode_seqs=n, context_tokens=ctx + n * j))
            t += d
            durations.append(d)
            ends.append(t)
        return durations, ends

    @staticmethod
    def shape(plan: StepPlan) -> BatchShape:
        return BatchShape.from_lengths(prefill=[(s.num_tokens, s.start_pos) for s in plan.prefill],
                                       decode=[s.start_pos + 1 for s in plan.decode])

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.is_empty:
            return StepResult()
        sampled = {s.request_id: PLACEHOLDER_TOKEN for s in plan.slices if s.sample}
        return StepResult(sampled=sampled, step_seconds=self.cost.iteration_seconds(self.shape(plan)))
