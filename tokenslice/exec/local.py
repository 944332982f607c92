"""LocalExecutor: the model in this process; a plan completes when executed."""
from __future__ import annotations

from tokenslice.exec.base import ImmediateExecutor
from tokenslice.model.runner import ModelRunner
from tokenslice.plan import StepPlan, StepResult


class LocalExecutor(ImmediateExecutor):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.runner = runner

    def run(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def close(self) -> None:
        """Stop the runner's transfer threads (after their queued copies). Idempotent."""
        self.runner.close()
