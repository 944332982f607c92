"""Requests whose grammar (structured outputs) is compiling: off the step loop, on a thread of its
own, so a constrained request never holds up the others. Most grammars compile within a few
milliseconds: `submit` waits that long, so a grammar xgrammar refuses is still the client's 400;
a longer compile lets the request join the scheduler at the first step after it ends, and one
past `compile_limit_s` fails the request (a hostile schema cannot hold a slot forever)."""
from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenslice.request import InvalidRequestError, Request

if TYPE_CHECKING:  # xgrammar loads with the first structured request
    from tokenslice.model.grammar import Grammars

# How long `submit` waits for a compile before the request waits in the queue instead.
SUBMIT_WAIT_S = 0.05
COMPILE_LIMIT_S = 30.0


@dataclass
class PendingGrammar:
    request: Request
    future: cf.Future
    deadline: float  # clock time: past it, the request fails
    delivery_rate: float | None  # the request's own reader pace, for Scheduler.add


class GrammarQueue:
    def __init__(self, source: Callable[[], Grammars], compile_limit_s: float = COMPILE_LIMIT_S,
                 submit_wait_s: float = SUBMIT_WAIT_S) -> None:
        self._source = source
        self._grammars: Grammars | None = None
        self.compile_limit_s = compile_limit_s
        self.submit_wait_s = submit_wait_s  # 0: never wait, every request goes through the queue
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenslice-grammar")
        self._pending: dict[str, PendingGrammar] = {}

    def grammars(self) -> Grammars:
        """The compiled grammars of this process (the local sampler shares them)."""
        if self._grammars is None:
            self._grammars = self._source()
        return self._grammars

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, req: Request, now: float, delivery_rate: float | None = None) -> bool:
        """Start compiling `req`'s grammar; True when it is compiled already (admit it now).
        Raises InvalidRequestError for a grammar that does not compile."""
        from tokenslice.model.grammar import GrammarError

        assert req.params.structured is not None
        future = self._pool.submit(lambda spec=req.params.structured: self.grammars().compile(spec))
        if self.submit_wait_s > 0:
            try:
                future.result(timeout=self.submit_wait_s)
                return True
            except cf.TimeoutError:
                pass
            except GrammarError as e:
                raise InvalidRequestError(f"structured output: {e}", "structured") from None
        self._pending[req.request_id] = PendingGrammar(req, future, now + self.compile_limit_s, delivery_rate)
        return False

    def ready(self, now: float, wait_s: float = 0.0) -> tuple[list[tuple[Request, float | None]], dict[str, str]]:
        """Requests whose grammar compiled (to admit, with their delivery rates), and those that
        failed with why. `wait_s`: wait that long for a compile to end (an engine with nothing
        else to do)."""
        if wait_s > 0 and self._pending:
            cf.wait([p.future for p in self._pending.values()], timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        admitted: list[tuple[Request, float | None]] = []
        failed: dict[str, str] = {}
        for rid, p in list(self._pending.items()):
            if p.future.done():
                del self._pending[rid]
                error = p.future.exception()
                if error is None:
                    admitted.append((p.request, p.delivery_rate))
                else:
                    failed[rid] = f"structured output: {error}"
            elif now >= p.deadline:
                del self._pending[rid]  # the compile runs on; its result goes to the cache
                failed[rid] = f"structured output: the grammar did not compile within {self.compile_limit_s:g} s"
        return admitted, failed

    def abort(self, request_id: str) -> bool:
        return self._pending.pop(request_id, None) is not None

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
