"""LocalExecutor: the model in this process. A plan runs when submitted, or, with `overlap`
(async scheduling), on one step thread, so that the engine plans the next step and handles the
last one's tokens while this one computes; plans run in submission order either way."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from tokenslice.exec.base import ImmediateExecutor
from tokenslice.model.runner import ModelRunner
from tokenslice.plan import StepPlan, StepResult


class LocalExecutor(ImmediateExecutor):
    def __init__(self, runner: ModelRunner, overlap: bool = False) -> None:
        super().__init__()
        self.runner = runner
        self._thread: ThreadPoolExecutor | None = None
        self._futures: deque[Future[StepResult]] = deque()
        self.set_overlap(overlap)

    def set_overlap(self, on: bool) -> None:
        """Start or stop the step thread; only with no plan in flight."""
        if self._futures:
            raise RuntimeError("set_overlap with plans in flight")
        if on and self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenslice-step", initializer=self._on_device)
        elif not on and self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _on_device(self) -> None:
        """The step thread's current CUDA device is the model's (a new thread starts on device 0,
        where the model's CUDA graphs could not be launched)."""
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.runner.device)

    def run(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> None:
        if self._thread is None:
            super().submit(plan)
        else:
            self._futures.append(self._thread.submit(self.runner.execute, plan))

    def poll(self) -> StepResult:
        """The oldest submitted plan's result (what its step raised, raised here)."""
        if self._thread is None:
            return super().poll()
        if not self._futures:
            raise RuntimeError("poll() with no plan submitted")
        return self._futures.popleft().result()

    def close(self) -> None:
        """Finish the plans in flight, then stop the runner's transfer threads (after their
        queued copies). Idempotent."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.runner.close()
