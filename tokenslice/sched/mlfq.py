"""Multi-level feedback queues (FastServe §4.1): classic MLFQ and skip-join MLFQ."""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable
from typing import Any

from tokenslice.request import Request
from tokenslice.sched.policy import Policy, PolicyContext, queue_position_estimates

# Starvation limit when none is configured: the time to generate this many tokens at the
# SLO pace (normalized-latency SLO x tokens). A job paused this long is already failing it.
STARVATION_SLO_TOKENS = 50
# Iteration times match a quantum within this relative slack: the cost model is not more
# precise than that, and a few prompt tokens over a decode step must not push a job out of Q1.
QUANTUM_SLACK = 0.05
# Queue keys of jobs placed inside a simulated window sort after every real placement.
_WINDOW_SEQ = 1 << 62


class SkipJoinMLFQPolicy(Policy):
    """Queues Q1..Qn with quanta q1 * ratio**i; q1 is the shortest iteration (FastServe Alg. 1).

    Skip-join: an arriving job enters the highest queue whose quantum covers its first
    iteration (its prefill), so long prompts do not first block Q1. Classic MLFQ
    (`skip_join=False`) enters everyone at Q1. A job that uses up its quantum is demoted to the
    next queue whose quantum covers its next iteration. A job that waited longer than the
    starvation limit is promoted to Q1, with an extra quantum when its next iteration would
    not fit in q1.
    """

    def __init__(self, ctx: PolicyContext, skip_join: bool = True) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.name = "skip-join-mlfq" if skip_join else "mlfq"
        self.skip_join = skip_join
        q1 = ctx.min_iteration_s()
        self.quanta = [q1 * cfg.mlfq_quantum_ratio ** i for i in range(cfg.mlfq_num_queues)]
        self.starvation_limit = cfg.starvation_limit_s or STARVATION_SLO_TOKENS * ctx.slo_normalized_latency()
        self.queues: list[dict[str, Request]] = [{} for _ in self.quanta]
        self.level: dict[str, int] = {}
        self.budget: dict[str, float] = {}  # quantum left at the current level
        self.seq: dict[str, int] = {}  # placement order; a queue is ordered by it
        self._computed: dict[str, int] = {}  # KV tokens at the last charge: what a step computed
        self._seq = itertools.count()
        self.last_run: dict[str, float] = {}  # last time the job ran (or arrived, or was promoted)
        self._starve_heap: list[tuple[float, int, str]] = []  # (last_run, tiebreak, id); lazy deletion
        self._tiebreak = itertools.count()
        self.num_promotions = 0
        self.num_demotions = 0

    # ---- queue moves ----------------------------------------------------------------------
    def _level_for(self, seconds: float, at_least: int = 0) -> int:
        """Highest queue at or below `at_least` whose quantum covers `seconds`."""
        i = bisect.bisect_left(self.quanta, seconds / (1 + QUANTUM_SLACK), lo=at_least)
        return min(i, len(self.quanta) - 1)

    def _place(self, req: Request, level: int, budget: float, now: float) -> None:
        rid = req.request_id
        old = self.level.get(rid)
        if old is not None:
            self.queues[old].pop(rid, None)
        self.queues[level][rid] = req
        self.level[rid] = level
        self.seq[rid] = next(self._seq)
        self.budget[rid] = budget
        self._touch(rid, now)

    def _touch(self, rid: str, now: float) -> None:
        self.last_run[rid] = now
        heapq.heappush(self._starve_heap, (now, next(self._tiebreak), rid))

    def _next_iteration_s(self, req: Request) -> float:
        # A job that has generated is decoding, even if its KV was dropped: the recompute is
        # the server's overhead, and placing the job by it would sink it to a deep queue where
        # it starves, is promoted, is dropped again, and makes no progress.
        if req.num_computed_tokens == 0 and not req.output_token_ids:
            return self.ctx.first_iteration_s(req.num_tokens)
        return self.ctx.decode_s(req.num_tokens)

    # ---- Policy protocol ------------------------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        level = self._level_for(self.ctx.first_iteration_s(req.num_prompt_tokens)) if self.skip_join else 0
        self._place(req, level, self.quanta[level], now)

    def _charge(self, req: Request, step_seconds: float) -> float:
        """Quantum a job used in a step (dropped KV rebuilt from zero: the token, not the
        recompute)."""
        rid, computed = req.request_id, req.num_computed_tokens
        last = self._computed.get(rid, 0)
        self._computed[rid] = computed
        return self._step_charge(computed - last if computed > last else 1, req.num_tokens, step_seconds)

    def _step_charge(self, new_tokens: int, context: int, step_seconds: float) -> float:
        """A job's own iteration time, at most the step's (FastServe §4.1 measures quanta in the
        job's iteration time). Charging the whole step would demote a short decode for the long
        prefill that happened to share its batch."""
        own = self.ctx.decode_s(context) if new_tokens == 1 else self.ctx.first_iteration_s(new_tokens)
        return own if own < step_seconds else step_seconds  # min(), without a call: a hot path

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        for req in ran:
            rid = req.request_id
            if rid not in self.level:
                continue
            left = self.budget[rid] - self._charge(req, step_seconds)
            if left > 0:
                self.budget[rid] = left
                self._touch(rid, now)
                continue
            # Quantum used up: demote to the next queue that fits the next iteration.
            level = self._level_for(self._next_iteration_s(req), self.level[rid] + 1)
            self.num_demotions += 1
            self._place(req, level, self.quanta[level], now)
        self._promote_starving(now)

    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        """Steps the batch may repeat: until a waiting job starves, or a batch job's quantum runs
        out and its new queue puts it behind a waiting job (a demotion nobody overtakes on is
        silent, and the batch stays)."""
        limit = len(ends)
        heap = self._starve_heap
        while heap and self.last_run.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)  # drop stale entries so the top is a real deadline
        if heap:
            limit = min(limit, bisect.bisect_left(ends, heap[0][0] + self.starvation_limit) + 1)
        limit, _, _ = self._window(ran, durations[:limit], [r.num_tokens for r in ran], exact_budgets=False)
        return max(1, limit)

    def on_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> None:
        """Charge a run of steps at once, applying its demotions in the order and at the times
        step-by-step charging would; stable_steps guaranteed nothing else moves."""
        k = len(durations)
        _, events, budgets = self._window(ran, durations, [r.num_tokens - k for r in ran])
        by_id = {r.request_id: r for r in ran}
        for r in ran:
            self._computed[r.request_id] = r.num_computed_tokens
        for j, _lvl, _key, rid, new_level in sorted(events, key=lambda e: e[:3]):
            self.num_demotions += 1
            self._place(by_id[rid], new_level, self.quanta[new_level], ends[j])
        for rid, left in budgets.items():
            self.budget[rid] = left
            self._touch(rid, ends[-1])
        self._promote_starving(ends[-1])

    def _window(self, ran: list[Request], durations: list[float], tokens_before: list[int],
                exact_budgets: bool = True) -> tuple[int, list[tuple], dict[str, float]]:
        """Replay the batch's quantum accounting over `durations` (same subtraction order as
        step by step). Returns the steps it may run, its demotions (step, old level, queue key,
        id, new level) and the budgets left at the end (only when `exact_budgets`)."""
        limit = len(durations)
        ran_ids = {r.request_id for r in ran if r.request_id in self.level}
        best_waiting = self._best_waiting_level(ran_ids)
        events: list[tuple] = []
        budgets: dict[str, float] = {}
        # A job charges at most the step time, so one whose budget exceeds the whole window's
        # cannot be demoted in it; only its final budget needs the exact replay.
        window_s = sum(durations) * (1 + 1e-9)
        charge = self._step_charge
        for req, tokens in zip(ran, tokens_before, strict=True):
            rid = req.request_id
            if rid not in ran_ids:
                continue
            level, left, key = self.level[rid], self.budget[rid], (self.seq[rid], ())
            if not exact_budgets and left > window_s:
                continue
            for j in range(limit):
                # A decode step, charged with the context the job has after step j.
                left -= charge(1, tokens + j + 1, durations[j])
                if left > 0:
                    continue
                # Demoted at the end of step j, with the context it then has.
                new_level = self._level_for(self.ctx.decode_s(tokens + j + 1), level + 1)
                events.append((j, level, key, rid, new_level))
                # Same-step demotions land in queue order: (step, old level, old key) sorts them.
                level, left, key = new_level, self.quanta[new_level], (_WINDOW_SEQ + j, (level, key))
                if new_level >= best_waiting:  # a waiting job now ranks ahead: the batch changes
                    limit = j + 1
                    break
            budgets[rid] = left
        return limit, [e for e in events if e[0] < limit], budgets

    def _best_waiting_level(self, running: set[str]) -> float:
        """The best queue holding a live job outside the batch (inf if none)."""
        per_level: dict[int, int] = {}
        for rid in running:
            per_level[self.level[rid]] = per_level.get(self.level[rid], 0) + 1
        for i, q in enumerate(self.queues):
            if len(q) > per_level.get(i, 0):
                return i
        return float("inf")

    def _promote_starving(self, now: float) -> None:
        heap = self._starve_heap
        while heap and heap[0][0] + self.starvation_limit <= now:
            t, _, rid = heapq.heappop(heap)
            if self.last_run.get(rid) != t:
                continue  # stale entry: the job ran or finished since
            req = self.queues[self.level[rid]][rid]
            # FastServe §4.1: a promoted job whose next iteration exceeds q1 gets the quantum it
            # needs, so it is not demoted straight back without progress.
            self.num_promotions += 1
            self._place(req, 0, max(self.quanta[0], self._next_iteration_s(req)), now)

    def on_finish(self, req: Request) -> None:
        rid = req.request_id
        level = self.level.pop(rid, None)
        if level is not None:
            self.queues[level].pop(rid, None)
        self.budget.pop(rid, None)
        self.seq.pop(rid, None)
        self._computed.pop(rid, None)
        self.last_run.pop(rid, None)

    def ranked(self, now: float) -> Iterable[Request]:
        self._promote_starving(now)
        return itertools.chain.from_iterable(q.values() for q in self.queues if q)

    def describe_queues(self) -> dict[str, Any]:
        """Every queue with its quantum, and each job's quantum left at its level."""
        return {"kind": "mlfq", "starvation_limit_s": self.starvation_limit,
                "queues": [{"level": i, "quantum_s": q,
                            "requests": [{"id": rid, "quantum_left_s": self.budget[rid]} for rid in self.queues[i]]}
                           for i, q in enumerate(self.quanta)]}

    def top_queue_jobs(self, k: int) -> Iterable[Request]:
        """Jobs of the top k queues (FastServe §4.2 burst reserve counts them)."""
        return itertools.chain.from_iterable(q.values() for q in self.queues[:k])

    def next_run_estimates(self, now: float) -> dict[str, float]:
        """FastServe §4.2 ENST: the sooner of promotion and the drain of higher-priority work."""
        ranked = list(self.ranked(now))
        exec_s = queue_position_estimates(ranked, self.budget, self.ctx.max_batch_size)
        return {rid: min(t, max(0.0, self.last_run[rid] + self.starvation_limit - now))
                for rid, t in exec_s.items()}
