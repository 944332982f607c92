"""The stall guard (docs/DESIGN.md, "Stall guard"): over every policy, bound how long a started
stream waits for its next token. Each started stream has a deadline: when its reader, taking
`delivery_rate` tokens/s, runs out of tokens (Andes, arXiv 2404.16283: a stream ahead of its
reader can pause unseen), and `max_stall_ms` after its last token. One whose deadline falls
within the horizon is protected: it runs in the next step ahead of the policy's ranking and is
not evicted. The policy keeps its ranking; the guard only protects, at the last moment."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

from tokenslice.config import SchedulerConfig
from tokenslice.request import Request

# Steps whose longest duration sets the horizon: long enough to remember a prefill-heavy step.
STEP_WINDOW = 32
# At most this share of a batch is the guard's; the policy fills the rest by its own ranking, so
# many started streams (one client's many ids, a long backlog) cannot take fairness or TTFT away.
MAX_PROTECTED_SHARE = 0.5


class StallGuard:
    def __init__(self, config: SchedulerConfig) -> None:
        self.timeline = config.stall_guard == "on"
        self.max_stall_s = None if config.max_stall_ms is None else config.max_stall_ms / 1000.0
        # A batch of one stays the policy's: the guard would otherwise decide every step alone.
        self.max_protected = int(config.max_batch_size * MAX_PROTECTED_SHARE)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.protected: list[Request] = []  # of the last plan, earliest deadline first
        self._protected_ids: set[str] = set()
        # (deadline, request id) of every started stream, pushed at each of its tokens: a stream's
        # deadline moves only then, so a plan reads only the due head. Stale entries (an older
        # deadline, a finished stream) are dropped as they surface.
        self._due: list[tuple[float, str]] = []

    @property
    def enabled(self) -> bool:
        return self.timeline or self.max_stall_s is not None

    def deadline(self, req: Request) -> float | None:
        """When the stream's next token is due; None for a stream not started (or no guard)."""
        m = req.metrics
        if not m.token_times or not self.enabled:
            return None
        due = float("inf")
        if self.max_stall_s is not None:
            due = m.token_times[-1] + self.max_stall_s
        if self.timeline and m.read_time is not None:
            due = min(due, m.read_time + 1.0 / req.delivery_rate)
        return due

    def slack(self, req: Request, now: float) -> float | None:
        due = self.deadline(req)
        return None if due is None else due - now

    def horizon(self) -> float:
        """A stream is protected this long before its deadline: two of the longest recent steps,
        so one not protected at this plan is protected at the next, whose step still ends in time."""
        return 2.0 * max(self._steps, default=0.0)

    def observe_step(self, seconds: float) -> None:
        self._steps.append(seconds)

    def on_token(self, req: Request) -> None:
        """`req` got a token: its deadline moved."""
        due = self.deadline(req)
        if due is not None:
            heapq.heappush(self._due, (due, req.request_id))

    def _live_due(self, requests: Mapping[str, Request]) -> Iterator[tuple[float, Request]]:
        """Live started streams in deadline order, popping stale entries on the way; the caller
        pushes back what it took (restore)."""
        while self._due:
            due, rid = self._due[0]
            req = requests.get(rid)
            if req is None or self.deadline(req) != due:
                heapq.heappop(self._due)
                continue
            heapq.heappop(self._due)
            yield due, req

    def _restore(self, taken: list[tuple[float, Request]]) -> None:
        for due, req in taken:
            heapq.heappush(self._due, (due, req.request_id))

    def begin_plan(self, requests: Mapping[str, Request], now: float) -> None:
        """Which started streams must run in the next step: earliest deadline first, at most
        max_protected of them."""
        self.protected = []
        self._protected_ids = set()
        if not self.enabled or self.max_protected == 0:
            return
        limit = now + self.horizon()
        taken: list[tuple[float, Request]] = []
        for due, req in self._live_due(requests):
            taken.append((due, req))
            if due > limit or len(taken) > self.max_protected:
                break
        self._restore(taken)
        self.protected = [r for d, r in taken[:self.max_protected] if d <= limit]
        self._protected_ids = {r.request_id for r in self.protected}

    def is_protected(self, request_id: str) -> bool:
        return request_id in self._protected_ids

    def order(self, ranked: Iterable[Request]) -> Iterator[Request]:
        """The policy's ranking with the protected streams moved to its head (EDF among them)."""
        yield from self.protected
        if not self._protected_ids:
            yield from ranked
            return
        for req in ranked:
            if req.request_id not in self._protected_ids:
                yield req

    def next_run_bound(self, req: Request, now: float) -> float | None:
        """Seconds until the guard will make `req` run at the latest (proactive swap's uploads
        and victim order count on it), or None if it does not bound it."""
        due = self.deadline(req)
        return None if due is None else max(0.0, due - now - self.horizon())

    def stable_steps(self, requests: Mapping[str, Request], batch: set[str], durations: list[float],
                     ends: list[float]) -> int:
        """Simulator fast-forward: how many of the upcoming steps (lasting `durations`, ending at
        `ends`) the `batch` may repeat before a live started stream outside it becomes protected
        at the plan after a step; protection at the end of step j allows j + 1 steps."""
        if not self.enabled:
            return len(ends)
        taken: list[tuple[float, Request]] = []
        first_due = None
        for due, req in self._live_due(requests):
            taken.append((due, req))
            if req.request_id not in batch:
                first_due = due
                break
        self._restore(taken)
        if first_due is None:
            return len(ends)
        window = deque(self._steps, maxlen=STEP_WINDOW)
        for j, (d, end) in enumerate(zip(durations, ends, strict=True)):
            window.append(d)
            if first_due <= end + 2.0 * max(window):
                return j + 1
        return len(ends)
