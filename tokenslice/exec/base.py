"""The Executor interface (docs/DESIGN.md, Executor), and its submit/poll side for executors that
finish a plan as soon as it is submitted (several plans may be in flight for pipeline
parallelism; these simply have none left in flight)."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from tokenslice.plan import StepPlan, StepResult


class Executor(Protocol):
    """Runs plans. `submit` hands over a plan and `poll` returns the oldest submitted plan's
    result, so several plans may be in flight (pipeline parallelism); `execute(plan)` is
    submit + poll, what the engine loop calls with one plan in flight."""

    def submit(self, plan: StepPlan) -> None: ...

    def poll(self) -> StepResult: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def close(self) -> None: ...


class ImmediateExecutor:
    """Subclasses implement `run(plan)`; results come back from `poll` in submission order."""

    def __init__(self) -> None:
        self._results: deque[StepResult] = deque()

    def run(self, plan: StepPlan) -> StepResult:
        raise NotImplementedError

    def submit(self, plan: StepPlan) -> None:
        self._results.append(self.run(plan))

    def poll(self) -> StepResult:
        """The oldest submitted plan's result."""
        if not self._results:
            raise RuntimeError("poll() with no plan submitted")
        return self._results.popleft()

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.poll()


class WorkerError(RuntimeError):
    """A rank worker (process or Ray actor) died or raised; the executor cannot run further plans."""
