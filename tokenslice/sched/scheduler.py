"""Scheduler: walks the policy's order, fills a batch under the step limits and the KV pool,
and returns a StepPlan; after the step it records tokens and finishes requests (docs/DESIGN.md).
What happens to KV when memory is short is the preemption strategy's (sched/preemption.py)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from tokenslice.config import SchedulerConfig
from tokenslice.kv.manager import KVManager, PrefixHit
from tokenslice.plan import StepPlan, StepResult, request_slice
from tokenslice.predict.cost import CostModel
from tokenslice.request import Request, RequestState
from tokenslice.sched.policy import Policy, PolicyContext
from tokenslice.sched.registry import PREEMPTION_STRATEGIES, make_policy
from tokenslice.sched.stall_guard import StallGuard
from tokenslice.sched.stats import SchedulerStats


class InFlight(NamedTuple):
    """A request's share of the plans submitted and not yet updated."""

    plans: int
    tokens: int  # tokens they compute
    samples: int  # tokens they sample


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy, kv: KVManager,
                 ctx: PolicyContext | None = None, *, swap_block_bytes: int = 0) -> None:
        """`swap_block_bytes`: one KV block as moved over the host link (swap accounting)."""
        config.validate()
        self.config = config
        self.policy = policy
        self.kv = kv
        self.ctx = ctx or PolicyContext(config)
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.stall_guard = StallGuard(config)
        self.preemption = PREEMPTION_STRATEGIES[config.preemption](
            config, policy, kv, self.ctx, self.stats, self.requests, swap_block_bytes, stall_guard=self.stall_guard)
        self._released: list[str] = []  # finished since the last plan; the executor may forget them
        self._finished: list[Request] = []  # finished since the engine last asked
        self._running: set[str] = set()  # chosen by the last plan
        self._stalled: list[Request] = []  # chosen by rank but waiting for their KV this step
        # Plans with slices not yet updated (none between synchronous steps). Their requests are
        # in flight: with pipeline stages their token is in the pipe and they join no other batch
        # (FastServe §4.3); with `plan_ahead` (async scheduling) they are planned again, past the
        # token still being sampled.
        self._unsettled: deque[StepPlan] = deque()
        self.plan_ahead = False

    # ---- membership -------------------------------------------------------------------------
    def add(self, req: Request, now: float, delivery_rate: float | None = None) -> None:
        """`delivery_rate`: the request's own reader pace (tokens/s); None: the configured one."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        if req.request_id in self._in_flight():  # a late result would be taken for the new request's
            raise ValueError(f"request id {req.request_id!r} is still in a step in flight")
        req.delivery_rate = self.config.delivery_rate if delivery_rate is None else delivery_rate
        self.requests[req.request_id] = req
        self.preemption.on_arrival(req)
        self.policy.on_arrival(req, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort", now, RequestState.ABORTED)
        return req

    def set_priority(self, request_id: str, priority: int, now: float) -> bool:
        """Change a live request's priority; the next schedule() ranks by it, preempting running
        requests it now outranks (FastSwitch's priority updates). False if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        old = req.priority
        if priority != old:
            req.priority = priority
            self.policy.on_priority_change(req, old, now)
        return True

    def refine_prediction(self, request_id: str, output_tokens: int, now: float) -> None:
        """A new predicted total output length for a live request (the length predictor refined
        it from the model's own state); a policy that ranks by predictions (`on_prediction`) re-ranks it."""
        req = self.requests.get(request_id)
        if req is not None:
            req.predicted_output_tokens = output_tokens
            hook = getattr(self.policy, "on_prediction", None)
            if hook is not None:
                hook(req, now)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _count(self, state: RequestState) -> int:
        return sum(1 for r in self.requests.values() if r.state is state)

    @property
    def num_running(self) -> int:
        return self._count(RequestState.RUNNING)

    @property
    def num_waiting(self) -> int:
        return self._count(RequestState.WAITING)

    @property
    def num_preempted(self) -> int:
        return self._count(RequestState.PREEMPTED)

    @property
    def num_swapped(self) -> int:
        return sum(1 for rid in self.requests if self.kv.residency(rid) == "host")

    # ---- planning ---------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(finished=self._released)
        self._released = []
        self.preemption.begin_plan(now)
        self.kv.begin_plan()
        self.stall_guard.begin_plan(self.requests, now, blocks=self._guarded_blocks,
                                    kv_budget=self.kv.device.num_blocks, holding=self._load_unamortized)
        ranked = self.stall_guard.order(self.policy.ranked(now))
        seen: list[Request] = []  # ranked prefix walked so far; victims come from beyond it
        flights = self._in_flight()
        busy = set(flights)
        chosen, stalled, rest = self._fill_batch(ranked, seen, plan, now, flights)
        self.preemption.end_plan(chosen | busy, plan)
        self.preemption.offload_evicted(plan)
        self.kv.end_plan()
        if not chosen and self.requests and not stalled and not self.kv.num_in_flight and not busy:
            self._resolve_stall(seen + list(rest), now)
        for rid in self._running - chosen - busy:  # one in the pipe is not preempted: it runs
            req = self.requests.get(rid)
            if req is not None:
                self.preemption.preempt(req)
        self._running = chosen | (self._running & busy)
        self._stalled = stalled
        if plan.decode or plan.prefill:
            self._unsettled.append(plan)
        return plan

    def _guarded_blocks(self, req: Request) -> int | None:
        """The device blocks a started stream holds once it runs (the stall guard's KV budget),
        or None while its KV is being copied: it cannot run this step, it runs once it landed."""
        if self.kv.in_flight(req.request_id):
            return None
        return self.kv.blocks_for_tokens(req.num_tokens)

    def _load_unamortized(self, req: Request) -> bool:
        """Whether a stream the stall guard loaded is still owed service for its load."""
        return self.preemption.guard.is_protected(req.request_id)

    def _in_flight(self) -> dict[str, InFlight]:
        """The requests of the plans not yet updated (none between synchronous steps)."""
        flights: dict[str, InFlight] = {}
        for plan in self._unsettled:
            for sl in plan.slices:
                p, t, n = flights.get(sl.request_id, (0, 0, 0))
                flights[sl.request_id] = InFlight(p + 1, t + len(sl.token_ids), n + sl.sample)
        return flights

    def _settle(self, plan: StepPlan) -> None:
        """`plan` was updated (or lost): its requests are no longer in flight in it."""
        for i, p in enumerate(self._unsettled):
            if p is plan:  # the oldest, but for a plan lost out of order
                del self._unsettled[i]
                return

    def plan_lost(self, plan: StepPlan) -> None:
        """A plan whose step failed gets no update: its requests are no longer in flight (the
        engine aborts them)."""
        self._settle(plan)

    def _planned_ahead(self, req: Request, flight: InFlight) -> bool:
        """Whether a request in a plan in flight runs again in this one (async scheduling): only
        past the token it is sampling, and not when that token surely ends it (max_tokens, the
        context); an end found later (EOS, a stop string) drops this step's token."""
        return (self.plan_ahead and flight.plans == 1 and req.tokens_until_forced_stop > flight.samples
                and req.num_tokens + flight.samples > req.num_computed_tokens + flight.tokens)

    def keep_released(self, plan: StepPlan) -> None:
        """`plan` goes to no executor (nothing to run while other plans are in flight): the
        requests it released are handed over with the next plan instead."""
        self._released = plan.finished + self._released

    def _fill_batch(self, it: Iterator[Request], seen: list[Request], plan: StepPlan, now: float,
                    flights: dict[str, InFlight]) -> tuple[set[str], list[Request], Iterator[Request]]:
        """vLLM's allocate-or-preempt loop: take requests in rank order while the batch and token
        budget last, making room for each one's KV by evicting lower-ranked ones. Returns the
        chosen ids, the requests that would run but wait for their KV, and the unwalked rest."""
        kv, pre = self.kv, self.preemption
        budget = self.config.max_tokens_per_step
        chosen: set[str] = set()
        dropped: set[str] = set()
        stalled: list[Request] = []
        admission_blocked = False  # a new request is waiting for memory: no newer one may jump it
        while len(chosen) < self.config.max_batch_size and budget > 0:
            req = next(it, None)  # `it` is rebound when the rest of the order is materialized
            if req is None:
                break
            rid = req.request_id
            flight = flights.get(rid)
            if flight is not None and not self._planned_ahead(req, flight):
                continue  # its token is not back: the next pending job runs instead
            seen.append(req)
            if kv.in_flight(rid):  # never scheduled until its copy completes
                stalled.append(req)
                continue
            computed = req.num_computed_tokens + (flight.tokens if flight else 0)
            pending = flight.samples if flight else 0
            holds_kv = computed > 0
            protected = self.stall_guard.is_protected(rid)  # its reader waits: no queue holds it back
            if (admission_blocked and not holds_kv and not protected) or rid in dropped or (not holds_kv and self._follows(req)):
                continue
            on_host = kv.residency(rid) == "host"
            loads = on_host or not holds_kv  # its KV must be loaded: prefilled, recomputed or swapped in
            total = req.num_tokens + pending
            hit = None if holds_kv or on_host else self._attach_prefix(req)
            if hit is not None:
                computed = hit.num_tokens
            chunk = min(total - computed, budget)
            need = kv.blocks_for_tokens(computed + chunk) if on_host else kv.blocks_needed(rid, computed + chunk)
            if need > kv.device.num_free:
                lower = list(it)  # everything not yet walked is lower-ranked
                it = iter(lower)
                if not pre.make_room(need, lower, chosen.union(flights), holds_kv, plan, dropped, loads,
                                     protected):
                    admission_blocked = admission_blocked or not holds_kv
                    if hit is not None:
                        kv.detach_prefix(rid)
                    continue  # waits for memory: queueing, not swap stall
            if ((loads and not pre.load(req, on_host, plan))
                    or (hit is not None and not self._start_from_prefix(req, hit, plan))):
                stalled.append(req)  # its KV (or cached host prefix) is copied in during this step
                continue
            if loads and protected and pre.offloads_idle:  # kept running until the load pays off
                self.stall_guard.hold(rid)
            if loads or need:  # a resident request whose last block has room grows by nothing
                kv.ensure(rid, computed + chunk)
            chosen.add(rid)
            budget -= chunk
            self._add_slice(req, computed, chunk, computed + chunk == total, plan, now, pending)
        return chosen, stalled, it

    def _attach_prefix(self, req: Request) -> PrefixHit | None:
        """A new request starts from its longest cached prefix: only the rest is computed (vLLM)."""
        if self.kv.prefix is None or not req.cache_prefix or req.needs_prompt_logprobs:  # those need the logits
            return None
        return self.kv.attach_prefix(req.request_id, req.num_tokens, req.token_ids)

    def _follows(self, req: Request) -> bool:
        """A sibling sample waits while its leader computes their prompt, then attaches it (prefix cache)."""
        return self.kv.prefix is not None and req.waits_for(self.requests.get(req.prefix_leader or ""))

    def _start_from_prefix(self, req: Request, hit: PrefixHit, plan: StepPlan) -> bool:
        """The request runs from its cached prefix, counted as computed (vLLM); the part found
        on host is copied in (FastSwitch §3.3). False: that copy overlaps this step's compute
        and the request runs once it landed."""
        bs = self.kv.block_size
        req.num_computed_tokens = hit.num_tokens
        self.stats.record_prefix_lookup(req.num_tokens, hit.device_blocks * bs, hit.host_blocks * bs)
        if hit.host_blocks:
            return self.preemption.load_host_prefix(req, hit.host_blocks, plan)
        return True

    def _add_slice(self, req: Request, computed: int, chunk: int, sample: bool, plan: StepPlan, now: float,
                   pending: int) -> None:
        s = request_slice(req, computed, chunk, self.kv.block_table(req.request_id), sample, pending)
        (plan.decode if chunk == 1 else plan.prefill).append(s)
        req.mark_running(now)

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
        self._settle(plan)
        self.preemption.observe(plan, result)
        self.stall_guard.observe_step(result.step_seconds)
        for rid in result.transfers_done:  # also for requests aborted mid-transfer
            if self.kv.in_flight(rid):
                self.kv.end_transfer(rid)
        # Sync swap copies held the whole batch: swap stall, not execution (FastServe Fig. 15b).
        sync_s = result.transfer_seconds
        for req in self._stalled:
            if req.request_id in self.requests:
                req.metrics.swap_stall_s += result.step_seconds
        self._stalled = []
        per_token = (result.step_seconds - sync_s) / plan.num_tokens if plan.num_tokens else 0.0
        block_size = self.kv.block_size
        for s in plan.slices:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            self.preemption.guard.charge_service(s.request_id, per_token * len(s.token_ids))
            req.num_computed_tokens += len(s.token_ids)
            # Blocks fill up only where a chunk ends on a block boundary or passes one.
            if req.cache_prefix and (len(s.token_ids) > 1 or not req.num_computed_tokens % block_size):
                self.kv.cache_computed(s.request_id, req.num_computed_tokens, req.token_ids)
            m = req.metrics
            m.iterations += 1
            m.exec_s += result.step_seconds - sync_s
            m.swap_stall_s += sync_s
            ran.append(req)
            if not s.sample:
                if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:  # prompt only
                    self._finish(req, "length", now, RequestState.FINISHED)
                continue
            tok = result.sampled[s.request_id]
            req.output_token_ids.append(tok)
            m.add_token_time(now, req.delivery_rate)
            self.stall_guard.on_token(req)
            produced.append(req)
            reason = req.stop_reason(tok)
            if reason is not None:
                self._finish(req, reason, now, RequestState.FINISHED)
        self.policy.on_step(ran, result.step_seconds, now)
        return produced

    # ---- simulator fast-forward -----------------------------------------------------------------
    def repeatable_steps(self, plan: StepPlan) -> list[Request] | None:
        """The batch of a decode-only plan that nothing but the policy could change, or None."""
        if plan.prefill or plan.drop or plan.swap_in or plan.swap_out or plan.async_transfers or not plan.decode:
            return None
        if self._stalled or self.kv.num_in_flight:  # a completion would change the next plan
            return None
        if self.preemption.protection_blocked:  # an expiring protection would change the next plan
            return None
        if self.stall_guard.protected:  # the guard, not the policy, chose part of it
            return None
        live = self.requests
        return [live[s.request_id] for s in plan.decode] if all(s.request_id in live for s in plan.decode) else None

    def max_repeat(self, reqs: list[Request], max_steps: int) -> int:
        """Steps the batch may run before its first finish (that step included) or before its
        KV growth no longer fits in the free blocks."""
        k = min([max_steps] + [r.tokens_until_forced_stop for r in reqs])
        if k <= 0:
            return 0
        room = self.preemption.fast_forward_room(self.kv.device.num_free)
        return self.kv.steps_that_fit([(r.request_id, r.num_computed_tokens) for r in reqs], k, room)

    def stable_steps(self, reqs: list[Request], durations: list[float], ends: list[float]) -> int:
        """How many of the upcoming steps the batch `reqs` may repeat before the policy's order
        or the stall guard's protection could change the plan."""
        limit = self.policy.stable_steps(reqs, durations, ends)
        batch = {r.request_id for r in reqs}
        return min(limit, self.stall_guard.stable_steps(self.requests, batch, durations[:limit], ends[:limit]))

    def repeat_decode(self, reqs: list[Request], durations: list[float], ends: list[float],
                      token: int) -> None:
        """Apply len(durations) decode steps of `reqs` at once, exactly as that many
        schedule/update rounds would (the caller checked nothing else could change)."""
        k = len(durations)
        new_tokens = [token] * k
        self._unsettled.clear()  # the simulator's bulk steps stand for the one plan scheduled
        for d in durations:
            self.stall_guard.observe_step(d)
        for req in reqs:
            self.kv.ensure(req.request_id, req.num_computed_tokens + k)
            req.num_computed_tokens += k
            m = req.metrics
            m.iterations += k
            self.preemption.guard.charge_service(req.request_id, sum(durations) / len(reqs))
            service = m.exec_s
            for d in durations:
                service += d
            m.exec_s = service
            req.output_token_ids.extend(new_tokens)
            for end in ends:
                m.add_token_time(end, req.delivery_rate)
            self.stall_guard.on_token(req)
            if req.cache_prefix:
                self.kv.cache_computed(req.request_id, req.num_computed_tokens, req.token_ids)
        for req in reqs:  # finishes first, then the policy's charge, as in a single step
            reason = req.stop_reason(token)
            if reason is not None:
                self._finish(req, reason, ends[-1], RequestState.FINISHED)
        self.policy.on_steps(reqs, durations, ends)

    # ---- finishing ------------------------------------------------------------------------------
    def finish(self, request_id: str, reason: str, now: float) -> None:
        """Finish a live request for a reason found outside the scheduler (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason, now, RequestState.FINISHED)

    def _finish(self, req: Request, reason: str, now: float, state: RequestState) -> None:
        self.requests.pop(req.request_id, None)
        self.preemption.guard.forget(req.request_id)
        self.stall_guard.forget(req.request_id)
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


def build_scheduler(config: SchedulerConfig, cost: CostModel | None, *, block_size: int, device_blocks: int,
                    host_blocks: int, block_groups: bool, prefix_caching: bool, swap_block_bytes: int) -> Scheduler:
    """The scheduler of a real or simulated engine, over a KV manager for its pools: a host pool
    only where the preemption strategy swaps, block groups (FastSwitch §3.1) only there too, so
    a swap is a few large copies. `cost` is what the policies see."""
    swapping = PREEMPTION_STRATEGIES[config.preemption].uses_host_tier
    kv = KVManager(block_size, device_blocks, host_blocks if swapping else 0, contiguous=swapping and block_groups,
                   prefix_caching=prefix_caching)
    ctx = PolicyContext(config, cost)
    return Scheduler(config, make_policy(config.policy, ctx), kv, ctx, swap_block_bytes=swap_block_bytes)
