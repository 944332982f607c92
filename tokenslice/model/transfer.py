"""TransferEngine: background KV copies on a small pool of worker threads (docs/DESIGN.md, Layout;
here in model/ because the model runner is its only user).

FastSwitch (asynchronous multithreaded swap-in) and FastServe §4.2 (proactive offload/upload)
overlap KV transfers with compute: the executor starts a request's copy, keeps computing other
requests, and reports the request once the copy finished (StepResult.transfers_done). This
module is only the job machinery: each job is a callable the model runner builds (torch copies,
on CUDA a side stream it synchronizes before returning), so this module stays torch-free.

A job that raises is never swallowed: the next `poll` / `wait_any` raises TransferError naming
the request. Completed ids are reported once, in completion order.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class TransferError(RuntimeError):
    """A transfer job raised; `request_id` names the request whose copy failed."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"KV transfer of request {request_id!r} failed: {cause!r}")
        self.request_id = request_id


class TransferEngine:
    def __init__(self, num_threads: int = 2, name: str = "tokenslice-transfer") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._cond = threading.Condition()
        self._jobs: deque[tuple[str, Callable[[], object]] | None] = deque()  # None: a worker exits
        self._done: list[str] = []
        self._errors: list[TransferError] = []
        self._pending = 0  # submitted, not finished
        self._closed = False
        # Daemon threads: an owner that forgets close() must not hang interpreter exit.
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def submit(self, request_id: str, fn: Callable[[], object]) -> None:
        """Run fn() on a worker; request_id is reported by poll/wait_any once it returned."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"submit({request_id!r}): the transfer engine is closed")
            self._pending += 1
            self._jobs.append((request_id, fn))
            self._cond.notify_all()

    def pending(self) -> int:
        """Jobs submitted and not finished yet (finished but unpolled ones do not count)."""
        with self._cond:
            return self._pending

    def poll(self) -> list[str]:
        """Request ids whose jobs completed since the last poll; raises TransferError for a job
        that failed (the ids completed alongside it come with the next poll)."""
        with self._cond:
            return self._take()

    def wait_any(self, timeout: float | None = None) -> list[str]:
        """Block until at least one job completed since the last poll (or none is pending, or
        `timeout` seconds passed), then poll."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._errors or not self._pending, timeout)
            return self._take()

    def close(self) -> None:
        """Finish the queued jobs, then stop and join the workers. Idempotent."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._jobs.extend([None] * len(self._threads))
                self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------
    def _take(self) -> list[str]:
        if self._errors:
            raise self._errors.pop(0)
        done, self._done = self._done, []
        return done

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs)
                job = self._jobs.popleft()
            if job is None:
                return
            request_id, fn = job
            error: TransferError | None = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced to the owner on its next poll
                error = TransferError(request_id, e)
                error.__cause__ = e
            with self._cond:
                self._pending -= 1
                if error is None:
                    self._done.append(request_id)
                else:
                    self._errors.append(error)
                self._cond.notify_all()
