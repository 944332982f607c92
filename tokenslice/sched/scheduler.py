"""Scheduler: walks the policy's order, fills a batch under the step limits and the KV pool,
and returns a StepPlan; after the step it records tokens and finishes requests (DESIGN.md)."""
from __future__ import annotations

from tokenslice.config import SchedulerConfig
from tokenslice.kv.manager import KVManager
from tokenslice.plan import SeqSlice, StepPlan, StepResult
from tokenslice.request import Request, RequestState
from tokenslice.sched.policy import Policy


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy, kv: KVManager) -> None:
        config.validate()
        self.config = config
        self.policy = policy
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self._released: list[str] = []  # finished since the last plan; the executor may forget them
        self._finished: list[Request] = []  # finished since the engine last asked
        self._running: set[str] = set()  # chosen by the last plan
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    # ---- membership -------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self.requests[req.request_id] = req
        self.policy.on_arrival(req, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort", now, RequestState.ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.state is RequestState.RUNNING)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.state is RequestState.WAITING)

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.requests.values() if r.state is RequestState.PREEMPTED)

    # ---- planning ---------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        cfg = self.config
        kv = self.kv
        plan = StepPlan(finished=self._released)
        self._released = []
        ranked = self.policy.ranked(now)
        it = iter(ranked)
        seen: list[Request] = []  # ranked prefix walked so far; victims come from beyond it
        budget = cfg.max_tokens_per_step
        chosen: set[str] = set()
        dropped: set[str] = set()
        admission_blocked = False  # a new request is waiting for memory: no newer one may jump it
        while len(chosen) < cfg.max_batch_size and budget > 0:
            req = next(it, None)  # `it` is rebound when the rest of the order is materialized
            if req is None:
                break
            seen.append(req)
            computed = req.num_computed_tokens
            holds_kv = computed > 0
            if (admission_blocked and not holds_kv) or req.request_id in dropped:
                continue
            total = len(req.prompt_token_ids) + len(req.output_token_ids)
            chunk = min(total - computed, budget)
            need = kv.blocks_needed(req.request_id, computed + chunk)
            if need > kv.device.num_free:
                lower = list(it)  # everything not yet walked is lower-ranked
                it = iter(lower)
                if not self._make_room(need, lower, chosen, holds_kv, plan, dropped):
                    if not holds_kv:
                        admission_blocked = True
                    continue
            kv.ensure(req.request_id, computed + chunk)
            chosen.add(req.request_id)
            budget -= chunk
            s = SeqSlice(req.request_id, req.token_ids(computed, computed + chunk), computed,
                         kv.block_table(req.request_id), computed + chunk == total,
                         req.params, len(req.output_token_ids), req.eos_token_id)
            (plan.decode if chunk == 1 else plan.prefill).append(s)
            if req.state is not RequestState.RUNNING:
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                req.state = RequestState.RUNNING
        if not chosen and self.requests:
            self._resolve_stall(seen + list(it), now)
        for rid in self._running - chosen:
            req = self.requests.get(rid)
            if req is not None and req.state is RequestState.RUNNING:
                req.state = RequestState.PREEMPTED
                req.metrics.preemptions += 1
                self.num_preemptions += 1
        self._running = chosen
        return plan

    def _make_room(self, need: int, lower: list[Request], chosen: set[str], holds_kv: bool,
                   plan: StepPlan, dropped: set[str]) -> bool:
        """Free device blocks by dropping lower-ranked requests' KV (they recompute later).

        Under `defer` only a request that already holds KV may evict (it must progress, or the
        pool deadlocks); new work waits instead.
        """
        if self.config.preemption == "defer" and not holds_kv:
            return False
        victims = [r for r in reversed(lower) if r.request_id not in chosen and self.kv.holds(r.request_id)]
        freeable = self.kv.num_free_device_blocks + sum(self.kv.num_device_blocks(r.request_id) for r in victims)
        if freeable < need:
            return False
        for victim in victims:
            if self.kv.num_free_device_blocks >= need:
                break
            self._drop_kv(victim, plan)
            dropped.add(victim.request_id)
        return True

    def _drop_kv(self, req: Request, plan: StepPlan) -> None:
        self.kv.free(req.request_id)
        req.metrics.recomputed_tokens += req.num_computed_tokens
        self.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        if req.state is RequestState.RUNNING:
            req.metrics.preemptions += 1
            self.num_preemptions += 1
            self._running.discard(req.request_id)
        req.state = RequestState.WAITING
        plan.drop.append(req.request_id)

    def _resolve_stall(self, ranked: list[Request], now: float) -> None:
        """Nothing could run: one request holds the whole pool and cannot grow (two holders
        would let the higher evict the lower). Stop it rather than spin; its text so far goes
        back to the client with finish_reason 'length'."""
        holders = [r for r in ranked if self.kv.holds(r.request_id)]
        if len(holders) <= 1:
            self._finish(holders[0] if holders else ranked[0], "length", now, RequestState.FINISHED)

    # ---- after the step ---------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Record computed and sampled tokens; returns requests that got a new token."""
        ran: list[Request] = []
        produced: list[Request] = []
        for s in plan.slices:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += len(s.token_ids)
            m = req.metrics
            m.iterations += 1
            m.attained_service_s += result.step_seconds
            ran.append(req)
            if not s.sample:
                continue
            tok = result.sampled[s.request_id]
            req.output_token_ids.append(tok)
            m.token_times.append(now)
            produced.append(req)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason, now, RequestState.FINISHED)
        self.policy.on_step(ran, result.step_seconds, now)
        return produced

    # ---- simulator event skipping ---------------------------------------------------------------
    def repeatable_steps(self, plan: StepPlan) -> list[Request] | None:
        """The batch of a decode-only plan whose policy can bound repeats (see
        Policy.stable_steps), or None."""
        if plan.prefill or plan.drop or plan.swap_in or plan.swap_out or not plan.decode:
            return None
        if not hasattr(self.policy, "stable_steps"):
            return None
        reqs = []
        for s in plan.decode:
            req = self.requests.get(s.request_id)
            if req is None:
                return None
            reqs.append(req)
        return reqs

    def max_repeat(self, reqs: list[Request], max_steps: int) -> int:
        """Steps the batch may run before its first finish (that step included) or before its
        KV growth no longer fits in the free blocks."""
        k = max_steps
        for r in reqs:
            n_out = len(r.output_token_ids)
            k = min(k, r.params.max_tokens - n_out)
            if r.max_total_tokens is not None:
                k = min(k, r.max_total_tokens - len(r.prompt_token_ids) - n_out)
        if k <= 0:
            return 0
        kv = self.kv

        def growth(steps: int) -> int:
            return sum(kv.blocks_needed(r.request_id, r.num_computed_tokens + steps) for r in reqs)

        if growth(k) > kv.device.num_free:  # largest k whose growth fits (growth is monotone)
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if growth(mid) <= kv.device.num_free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        return k

    def repeat_decode(self, reqs: list[Request], durations: list[float], ends: list[float],
                      token: int) -> None:
        """Apply len(durations) decode steps of `reqs` at once, exactly as that many
        schedule/update rounds would (the caller checked nothing else could change)."""
        k = len(durations)
        new_tokens = [token] * k
        for req in reqs:
            self.kv.ensure(req.request_id, req.num_computed_tokens + k)
            req.num_computed_tokens += k
            m = req.metrics
            m.iterations += k
            service = m.attained_service_s
            for d in durations:
                service += d
            m.attained_service_s = service
            req.output_token_ids.extend(new_tokens)
            m.token_times.extend(ends)
        self.policy.on_steps(reqs, durations, ends)  # type: ignore[attr-defined]
        for req in reqs:
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason, ends[-1], RequestState.FINISHED)

    @staticmethod
    def _stop_reason(req: Request, tok: int) -> str | None:
        p = req.params
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                return "stop"
        if n >= p.max_tokens:
            return "length"
        if req.max_total_tokens is not None and len(req.prompt_token_ids) + n >= req.max_total_tokens:
            return "length"
        return None

    def finish(self, request_id: str, reason: str, now: float) -> None:
        """Finish a live request for a reason found outside the scheduler (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason, now, RequestState.FINISHED)

    def _finish(self, req: Request, reason: str, now: float, state: RequestState) -> None:
        self.requests.pop(req.request_id, None)
        self._running.discard(req.request_id)
        self.kv.free(req.request_id)
        req.state = state
        req.finish_reason = reason
        req.metrics.finish_time = now
        self.policy.on_finish(req)
        self._released.append(req.request_id)
        self._finished.append(req)

    def take_finished(self) -> list[Request]:
        out, self._finished = self._finished, []
        return out
