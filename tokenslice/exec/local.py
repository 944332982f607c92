"""LocalExecutor: the model in this process. A plan completes when submitted."""
from __future__ import annotations

from collections import deque

from tokenslice.model.runner import ModelRunner
from tokenslice.plan import StepPlan, StepResult


class LocalExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[StepResult] = deque()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    # The submit/poll pair lets pipelined executors keep several plans in flight.
    def submit(self, plan: StepPlan) -> None:
        self._done.append(self.runner.execute(plan))

    def poll(self) -> StepResult | None:
        return self._done.popleft() if self._done else None

    def close(self) -> None:
        """Stop the runner's transfer threads (after their queued copies). Idempotent."""
        self.runner.close()
