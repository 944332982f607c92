"""The stall guard (docs/DESIGN.md, "Stall guard"): over every policy, bound how long a started
stream waits for its next token. Each started stream has a deadline: when its reader, taking
`delivery_rate` tokens/s, runs out of tokens (Andes, arXiv 2404.16283: a stream ahead of its
reader can pause unseen), and `max_stall_ms` after its last token. One whose deadline falls
within the horizon is protected: it runs in the next step ahead of the policy's ranking and is
not evicted. The policy keeps its ranking; the guard only protects, at the last moment, and only
what the device can hold: the protected streams' KV fits the device pool together. A stream it
had to load where idle KV is offloaded ahead of need stays protected until the load is amortized."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping

from tokenslice.config import SchedulerConfig
from tokenslice.request import Request

# Steps whose longest duration sets the horizon: long enough to remember a prefill-heavy step.
STEP_WINDOW = 32
# At most this share of a batch is the guard's; the policy fills the rest by its own ranking, so
# many started streams (one client's many ids, a long backlog) cannot take fairness or TTFT away.
MAX_PROTECTED_SHARE = 0.5

# The device blocks a stream holds once it runs, or None where the guard may not protect it in
# this plan (the scheduler's answer: e.g. its KV is being copied).
GuardedBlocks = Callable[[Request], int | None]


class StallGuard:
    def __init__(self, config: SchedulerConfig) -> None:
        self.timeline = config.stall_guard == "on"
        self.max_stall_s = None if config.max_stall_ms is None else config.max_stall_ms / 1000.0
        # A batch of one stays the policy's: the guard would otherwise decide every step alone.
        self.max_protected = int(config.max_batch_size * MAX_PROTECTED_SHARE)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._horizon = 0.0  # of _steps, kept as they change: every plan and bound reads it
        self.protected: list[Request] = []  # of the last plan: held, then earliest deadline first
        self._protected_ids: set[str] = set()
        # (deadline, request id) of every started stream, pushed at each of its tokens: a stream's
        # deadline moves only then, so a plan reads only the due head. Stale entries (an older
        # deadline, a finished stream) are dropped as they surface.
        self._due: list[tuple[float, str]] = []
        self._deadlines: dict[str, float] = {}  # each live started stream's current deadline
        self._held: dict[str, None] = {}  # streams the guard loaded and keeps protected (see hold)

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
        return self._horizon

    def observe_step(self, seconds: float) -> None:
        self._steps.append(seconds)
        self._horizon = 2.0 * max(self._steps)

    def on_token(self, req: Request) -> None:
        """`req` got a token: its deadline moved."""
        due = self.deadline(req)
        if due is not None:
            self._deadlines[req.request_id] = due
            heapq.heappush(self._due, (due, req.request_id))

    def forget(self, request_id: str) -> None:
        """The stream finished: it has no deadline (its heap entries surface as stale)."""
        self._deadlines.pop(request_id, None)
        self._held.pop(request_id, None)

    def _live_due(self, requests: Mapping[str, Request]) -> Iterator[tuple[float, Request]]:
        """Live started streams in deadline order, popping stale entries on the way; the caller
        pushes back what it took (restore)."""
        while self._due:
            due, rid = self._due[0]
            req = requests.get(rid)
            if req is None or self._deadlines.get(rid) != due:
                heapq.heappop(self._due)
                continue
            heapq.heappop(self._due)
            yield due, req

    def _restore(self, taken: list[tuple[float, Request]]) -> None:
        for due, req in taken:
            heapq.heappush(self._due, (due, req.request_id))

    def begin_plan(self, requests: Mapping[str, Request], now: float, *, blocks: GuardedBlocks | None = None,
                   kv_budget: int | None = None, holding: Callable[[Request], bool] | None = None) -> None:
        """Which started streams must run in the next step, at most max_protected of them: the
        held ones while `holding` says their load is not yet amortized, then, earliest deadline
        first, those due within the horizon. A stream `blocks` rules out is skipped (a held one
        is released), and so is one whose KV would take the protected streams past `kv_budget`
        device blocks: protecting more than the device holds only makes protected streams evict
        and reload each other."""
        self.protected = []
        self._protected_ids = set()
        if not self.enabled or self.max_protected == 0:
            return
        budget = float("inf") if kv_budget is None else kv_budget
        for rid in list(self._held):
            req = requests.get(rid)
            left = None if req is None or holding is None or not holding(req) else self._admit(req, blocks, budget)
            if left is None:
                del self._held[rid]
            else:
                budget = left
        limit = now + self._horizon
        taken: list[tuple[float, Request]] = []
        if len(self.protected) < self.max_protected:
            for due, req in self._live_due(requests):
                taken.append((due, req))
                if due > limit:
                    break
                left = None if req.request_id in self._protected_ids else self._admit(req, blocks, budget)
                if left is None:
                    continue
                budget = left
                if len(self.protected) == self.max_protected:
                    break
        self._restore(taken)

    def _admit(self, req: Request, blocks: GuardedBlocks | None, budget: float) -> float | None:
        """Protect `req` if a slot is left and its KV fits `budget`: the budget left, or None."""
        need = 0 if blocks is None else blocks(req)
        if need is None or need > budget or len(self.protected) == self.max_protected:
            return None
        self.protected.append(req)
        self._protected_ids.add(req.request_id)
        return budget - need

    def hold(self, request_id: str) -> None:
        """The guard loaded this stream where idle KV is offloaded ahead of need: it stays
        protected until the load is amortized, or the next offload would undo the load after one
        token and the stream would be loaded again for its next one."""
        self._held[request_id] = None

    def is_protected(self, request_id: str) -> bool:
        return request_id in self._protected_ids

    def order(self, ranked: Iterable[Request]) -> Iterator[Request]:
        """The policy's ranking with the protected streams moved to its head."""
        yield from self.protected
        if not self._protected_ids:
            yield from ranked
            return
        for req in ranked:
            if req.request_id not in self._protected_ids:
                yield req

    def next_run_bounds(self, now: float) -> dict[str, float]:
        """Per started stream, seconds until the guard will make it run at the latest (proactive
        swap's uploads and victim order count on it); streams not started are not bounded."""
        horizon = self._horizon
        return {rid: max(0.0, due - now - horizon) for rid, due in self._deadlines.items()}

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
