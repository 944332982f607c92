"""Scheduler: walks the policy's order, fills a batch under the step limits and the KV pool,
and returns a StepPlan; after the step it records tokens and finishes requests (DESIGN.md)."""
from __future__ import annotations

import itertools

from tokenslice.config import SWAP_MODES, SchedulerConfig
from tokenslice.plan import copy_runs
from tokenslice.kv.manager import KVManager
from tokenslice.plan import BlockTransfer, SeqSlice, StepPlan, StepResult
from tokenslice.request import Request, RequestState
from tokenslice.sched.policy import Policy, PolicyContext


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy, kv: KVManager,
                 ctx: PolicyContext | None = None) -> None:
        config.validate()
        self.config = config
        self.policy = policy
        self.kv = kv
        self.ctx = ctx or PolicyContext(config)
        # Anti-thrashing: a job whose KV was just loaded (prefill, recompute or swap-in) may not be
        # evicted to load another until its service since the load repays the load's cost.
        self._protected_until: dict[str, float] = {}  # request id -> own-share seconds
        self._share: dict[str, float] = {}  # per request: its token share of the steps it ran in
        self.requests: dict[str, Request] = {}
        self._released: list[str] = []  # finished since the last plan; the executor may forget them
        self._finished: list[Request] = []  # finished since the engine last asked
        self._running: set[str] = set()  # chosen by the last plan
        self._stalled: list[Request] = []  # chosen by rank but waiting for their KV this step
        self._protection_blocked = False  # the last plan skipped a victim for its protection
        self._enst_now: float | None = None  # next-run estimates, computed once per plan on demand
        self._enst_cache: dict[str, float] | None = None
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        # Swapping (issue: KV memory under preemption); bytes as moved over the host link.
        self.swap_block_bytes = 0  # set by the engine: one block in its host format
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self.num_swap_ops = 0
        self.num_swap_fallbacks = 0  # evictions that recomputed because host space ran out
        self._reserve = 0  # the last burst reserve (proactive-swap)
        self._prompt_tokens = 0  # arrivals' prompt tokens, for the burst reserve's job size
        self._num_arrivals = 0

    # ---- membership -------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self.requests[req.request_id] = req
        self._prompt_tokens += req.num_prompt_tokens
        self._num_arrivals += 1
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
    def num_swapped(self) -> int:
        return sum(1 for rid in self.requests if self.kv.residency(rid) == "host")

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.requests.values() if r.state is RequestState.PREEMPTED)

    # ---- planning ---------------------------------------------------------------------------
    @property
    def swapping(self) -> bool:
        return self.config.preemption in SWAP_MODES

    def schedule(self, now: float) -> StepPlan:
        cfg = self.config
        kv = self.kv
        plan = StepPlan(finished=self._released)
        self._released = []
        proactive = cfg.preemption == "proactive-swap"
        ranked = self.policy.ranked(now)
        it = iter(ranked)
        seen: list[Request] = []  # ranked prefix walked so far; victims come from beyond it
        self._protection_blocked = False
        self._enst_now, self._enst_cache = now, None
        budget = cfg.max_tokens_per_step
        chosen: set[str] = set()
        dropped: set[str] = set()
        stalled: list[Request] = []  # would run now but their KV is in flight or on host
        admission_blocked = False  # a new request is waiting for memory: no newer one may jump it
        while len(chosen) < cfg.max_batch_size and budget > 0:
            req = next(it, None)  # `it` is rebound when the rest of the order is materialized
            if req is None:
                break
            seen.append(req)
            rid = req.request_id
            if kv.in_flight(rid):  # never scheduled until its copy completes
                stalled.append(req)
                continue
            computed = req.num_computed_tokens
            holds_kv = computed > 0
            if (admission_blocked and not holds_kv) or rid in dropped:
                continue
            on_host = kv.residency(rid) == "host"
            total = len(req.prompt_token_ids) + len(req.output_token_ids)
            chunk = min(total - computed, budget)
            need = kv.blocks_for_tokens(computed + chunk) if on_host else kv.blocks_needed(rid, computed + chunk)
            if need > kv.device.num_free:
                lower = list(it)  # everything not yet walked is lower-ranked
                it = iter(lower)
                if not self._make_room(need, lower, chosen, holds_kv, plan, dropped, loads=on_host or not holds_kv):
                    if not holds_kv:
                        admission_blocked = True
                    continue  # waits for memory: queueing, not swap stall
            if on_host:
                self._protect(req, self._swap_seconds(len(kv.host_blocks(rid))))
                if proactive:  # upload overlapping this step's compute; it runs next step
                    self._move(req, "in", plan, sync=False)
                    stalled.append(req)
                    continue
                self._move(req, "in", plan, sync=True)  # reactive: in the critical path
            elif not holds_kv:
                self._protect(req, self.ctx.first_iteration_s(total - 1))
            kv.ensure(rid, computed + chunk)
            chosen.add(rid)
            budget -= chunk
            s = SeqSlice(rid, req.token_ids(computed, computed + chunk), computed,
                         kv.block_table(rid), computed + chunk == total,
                         req.params, len(req.output_token_ids), req.eos_token_id)
            (plan.decode if chunk == 1 else plan.prefill).append(s)
            if req.state is not RequestState.RUNNING:
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                req.state = RequestState.RUNNING
        if proactive:
            self._proactive_swaps(now, chosen, plan)
        kv.end_plan()
        if not chosen and self.requests and not stalled and not kv.num_in_flight:
            self._resolve_stall(seen + list(it), now)
        for rid in self._running - chosen:
            req = self.requests.get(rid)
            if req is not None and req.state is RequestState.RUNNING:
                req.state = RequestState.PREEMPTED
                req.metrics.preemptions += 1
                self.num_preemptions += 1
        self._running = chosen
        self._stalled = stalled
        return plan

    def _make_room(self, need: int, lower: list[Request], chosen: set[str], holds_kv: bool,
                   plan: StepPlan, dropped: set[str], loads: bool = False) -> bool:
        """Free device blocks by evicting lower-ranked requests' KV, lowest first: swapped out
        to host in the swap modes (when host has room), else dropped to recompute later.

        Under `defer` only a request that already holds KV may evict (it must progress, or the
        pool deadlocks); new work waits instead. A request that `loads` its KV (new, recomputing
        or on host) may not evict a protected job (see _protect); one growing its resident KV
        may, or the pool could deadlock.
        """
        if self.config.preemption == "defer" and not holds_kv:
            return False
        kv = self.kv
        victims = [r for r in reversed(lower) if r.request_id not in chosen and kv.holds(r.request_id)
                   and not kv.in_flight(r.request_id)]
        if self._enst_now is not None and len(victims) > 1:
            # FastServe §4.2: evict the job that will run last, not merely the lowest-ranked one:
            # a long-waiting job about to be promoted ranks low but runs soon.
            enst = self._enst()
            victims.sort(key=lambda r: enst.get(r.request_id, 0.0), reverse=True)
        if loads:
            unprotected = [r for r in victims if not self._is_protected(r)]
            if len(unprotected) < len(victims):
                self._protection_blocked = True
                victims = unprotected
        freeable = kv.num_free_device_blocks + sum(kv.num_device_blocks(r.request_id) for r in victims)
        if freeable < need:
            return False
        for victim in victims:
            if kv.num_free_device_blocks >= need:
                break
            if self.swapping and kv.can_swap_out(victim.request_id):
                self._move(victim, "out", plan, sync=True)
            else:
                if self.swapping:
                    self.num_swap_fallbacks += 1  # host full: recompute instead, never an error
                self._drop_kv(victim, plan)
                dropped.add(victim.request_id)
        return True

    def _move(self, req: Request, direction: str, plan: StepPlan, *, sync: bool) -> None:
        """Swap a request's KV out to host or in to device; sync copies run before this step's
        compute, async ones overlap it (the request waits for transfers_done)."""
        kv = self.kv
        rid = req.request_id
        if not sync:
            kv.begin_transfer(rid)
        pairs = kv.swap_out(rid) if direction == "out" else kv.swap_in(rid)
        if sync:
            (plan.swap_out if direction == "out" else plan.swap_in).extend(pairs)
        else:
            plan.async_transfers.append(BlockTransfer(rid, direction, pairs))  # type: ignore[arg-type]
        nbytes = len(pairs) * self.swap_block_bytes
        ops = len(copy_runs(pairs))
        m = req.metrics
        m.swaps += 1
        m.swap_ops += ops
        self.num_swap_ops += ops
        if direction == "out":
            m.swap_out_bytes += nbytes
            self.swap_out_bytes += nbytes
            if req.state is RequestState.RUNNING:
                req.state = RequestState.PREEMPTED
                req.metrics.preemptions += 1
                self.num_preemptions += 1
                self._running.discard(rid)
        else:
            m.swap_in_bytes += nbytes
            self.swap_in_bytes += nbytes

    def _protect(self, req: Request, load_s: float) -> None:
        """Anti-thrashing (the collapse FastServe §4.2 guards against with ENST-ordered swaps):
        when many jobs of similar priority want more KV than the device holds, MLFQ's short top
        quanta would rotate them through memory every few iterations, each rotation paying a
        swap or a recompute. A loaded job is protected from eviction by other loads until it has
        run for `eviction_amortization` x its load time, so loading costs at most that fraction
        of useful work."""
        factor = self.config.eviction_amortization
        if factor > 0:
            rid = req.request_id
            self._protected_until[rid] = self._share.get(rid, 0.0) + factor * load_s

    def _is_protected(self, req: Request) -> bool:
        until = self._protected_until.get(req.request_id)
        return until is not None and self._share.get(req.request_id, 0.0) < until

    def _swap_seconds(self, num_blocks: int) -> float:
        cost = self.ctx.cost
        return cost.transfer_seconds(num_blocks * self.swap_block_bytes, 1) if cost else 0.0

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

    # ---- proactive swapping (FastServe §4.2) ------------------------------------------------
    def burst_reserve_blocks(self) -> int:
        """Free device blocks to keep for a burst: max(K new jobs, jobs of the top K' queues
        not on device), a job sized by the mean prompt seen so far; at most a quarter of the
        pool, so the reserve never starves the running batch."""
        cfg = self.config
        jobs = cfg.burst_reserve_jobs
        top = getattr(self.policy, "top_queue_jobs", None)
        if top is not None and cfg.burst_reserve_queues > 0:
            kv = self.kv
            waiting = sum(1 for r in top(cfg.burst_reserve_queues) if not kv.holds(r.request_id))
            jobs = max(jobs, waiting)
        per_job = self.kv.blocks_for_tokens(self._prompt_tokens // max(1, self._num_arrivals) + 1)
        return min(jobs * per_job, self.kv.device.num_blocks // 4)

    def _enst(self) -> dict[str, float]:
        if self._enst_cache is None:
            self._enst_cache = self._next_run_estimates(self._enst_now or 0.0)
        return self._enst_cache

    def _next_run_estimates(self, now: float) -> dict[str, float]:
        """ENST (FastServe) / EWT (ALISE) per live request; rank position when the policy has
        no time estimate (the order is what matters for swapping)."""
        batch = getattr(self.policy, "next_run_estimates", None)
        if batch is not None:
            return batch(now)
        return {r.request_id: float(i) for i, r in enumerate(self.policy.ranked(now))}

    def _proactive_swaps(self, now: float, chosen: set[str], plan: StepPlan) -> None:
        """Keep the burst reserve free by offloading the idle jobs that will run last (largest
        ENST first), and upload host jobs that will run soonest (smallest ENST first) into
        free space above the reserve, so their copies overlap compute. A job moves at most once
        per transfer window, so it is never thrashed in and out in one step."""
        kv = self.kv
        target = self.burst_reserve_blocks()
        self._reserve = target
        free = kv.device.num_free + kv.device_blocks_releasing()
        reqs = self.requests
        idle = [r for rid, r in reqs.items() if rid not in chosen and kv.holds(rid) and not kv.in_flight(rid)]
        on_host = [r for rid, r in reqs.items() if not kv.in_flight(rid) and kv.residency(rid) == "host"]
        if not (free < target and idle) and not on_host:
            return
        enst = self._enst()
        offloaded = False
        if free < target and idle:
            idle.sort(key=lambda r: enst.get(r.request_id, 0.0), reverse=True)
            for r in idle:
                if free >= target:
                    break
                if not kv.can_swap_out(r.request_id):
                    break  # host full: keep the KV where it is (no proactive recompute)
                free += kv.num_device_blocks(r.request_id)
                self._move(r, "out", plan, sync=False)
                offloaded = True
        if offloaded or not on_host:
            return  # memory is tight: uploading now would only be offloaded again
        on_host = self._within_device_job_limit(on_host, target, now)
        on_host.sort(key=lambda r: enst.get(r.request_id, 0.0))
        for r in on_host:
            if kv.device.num_free - len(kv.host_blocks(r.request_id)) >= target:
                self._move(r, "in", plan, sync=False)

    def _within_device_job_limit(self, on_host: list[Request], reserve: int, now: float) -> list[Request]:
        """ALISE Algorithm 2: upload only jobs among the top-ranked ones the device can keep until
        they finish (the policy's device_job_limit, by predicted peak KV, over the pool above the
        burst reserve); a job past it would only be offloaded again as the ones ahead grow.
        Policies without a limit upload in ENST order alone."""
        limit_of = getattr(self.policy, "device_job_limit", None)
        if limit_of is None:
            return on_host
        kv = self.kv
        limit = limit_of((kv.device.num_blocks - reserve) * kv.block_size, now)
        keep = {r.request_id for r in itertools.islice(self.policy.ranked(now), limit)}
        return [r for r in on_host if r.request_id in keep]

    # ---- after the step ---------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Record computed and sampled tokens; returns requests that got a new token."""
        ran: list[Request] = []
        produced: list[Request] = []
        for rid in result.transfers_done:  # also for requests aborted mid-transfer
            if self.kv.in_flight(rid):
                self.kv.end_transfer(rid)
        # Sync swap copies held the whole batch: swap stall, not execution (FastServe Fig. 15b).
        sync_s = result.transfer_seconds
        for req in self._stalled:
            if req.request_id in self.requests:
                req.metrics.swap_stall_s += result.step_seconds
        self._stalled = []
        # A job's own share of a step, by tokens: what its residency bought (see _protect).
        per_token = (result.step_seconds - sync_s) / plan.num_tokens if plan.num_tokens else 0.0
        share = self._share
        for s in plan.slices:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            share[s.request_id] = share.get(s.request_id, 0.0) + per_token * len(s.token_ids)
            req.num_computed_tokens += len(s.token_ids)
            m = req.metrics
            m.iterations += 1
            m.attained_service_s += result.step_seconds - sync_s
            m.swap_stall_s += sync_s
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
        if plan.prefill or plan.drop or plan.swap_in or plan.swap_out or plan.async_transfers or not plan.decode:
            return None
        if self._stalled or self.kv.num_in_flight:  # a completion would change the next plan
            return None
        if self._protection_blocked:  # an expiring protection would change the next plan
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
            if r.eos_after is not None:
                k = min(k, r.eos_after - n_out)
            if r.max_total_tokens is not None:
                k = min(k, r.max_total_tokens - len(r.prompt_token_ids) - n_out)
        if k <= 0:
            return 0
        kv = self.kv

        def growth(steps: int) -> int:
            return sum(kv.blocks_needed(r.request_id, r.num_computed_tokens + steps) for r in reqs)

        room = kv.device.num_free
        if self.config.preemption == "proactive-swap" and room >= self._reserve:
            room -= self._reserve  # crossing into the burst reserve starts offloads: an event
        if growth(k) > room:  # largest k whose growth fits (growth is monotone)
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if growth(mid) <= room:
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
            self._share[req.request_id] = self._share.get(req.request_id, 0.0) + sum(durations) / len(reqs)
            service = m.attained_service_s
            for d in durations:
                service += d
            m.attained_service_s = service
            req.output_token_ids.extend(new_tokens)
            m.token_times.extend(ends)
        for req in reqs:  # finishes first, then the policy's charge, as in a single step
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason, ends[-1], RequestState.FINISHED)
        self.policy.on_steps(reqs, durations, ends)  # type: ignore[attr-defined]

    @staticmethod
    def _stop_reason(req: Request, tok: int) -> str | None:
        p = req.params
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                return "stop"
            if req.eos_after is not None and n >= req.eos_after:
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
        self._protected_until.pop(req.request_id, None)
        self._share.pop(req.request_id, None)
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
