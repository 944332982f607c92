"""What happens to KV when device memory is short (docs/DESIGN.md, "Preemption"): one strategy per
mode, chosen once from config (sched/registry.py). A strategy makes room (victim choice,
evictions by drop or swap), loads a job's KV back, keeps loaded jobs from thrashing, and records
every preemption, drop and swap in SchedulerStats. proactive-swap, which also moves KV ahead of
need and keeps a burst reserve, is in sched/proactive.py."""
from __future__ import annotations


from tokenslice.config import SchedulerConfig
from tokenslice.kv.manager import KVManager
from tokenslice.plan import BlockTransfer, Direction, StepPlan, StepResult, copy_runs
from tokenslice.request import Request, RequestState
from tokenslice.sched.policy import Policy, PolicyContext
from tokenslice.sched.protection import EvictionGuard
from tokenslice.sched.stall_guard import StallGuard
from tokenslice.sched.stats import SchedulerStats
from tokenslice.sched.swap_in import SwapInChoice


class Recompute:
    """`recompute`: a victim's KV is dropped and computed again when it next runs."""

    mode = "recompute"
    uses_host_tier = False
    new_work_evicts = True  # a request without KV may evict others to start
    async_swap_in = False  # the mode's own swap-in: in the step's critical path
    # Offloads idle jobs' KV on its own (proactive-swap's burst reserve), past the anti-thrashing
    # rule: a stream the stall guard loads then keeps running until the load is amortized.
    offloads_idle = False

    def __init__(self, config: SchedulerConfig, policy: Policy, kv: KVManager, ctx: PolicyContext,
                 stats: SchedulerStats, requests: dict[str, Request], swap_block_bytes: int = 0, *,
                 stall_guard: StallGuard | None = None) -> None:
        self.config = config
        self.policy = policy
        self.kv = kv
        self.ctx = ctx
        self.stats = stats
        self.requests = requests  # the scheduler's live requests (read only)
        self.swap_block_bytes = swap_block_bytes  # one block in its host format
        self.guard = EvictionGuard(config.eviction_amortization)
        self.stall_guard = stall_guard or StallGuard(config)  # its protected streams are never evicted
        self.protection_blocked = False  # the last plan skipped a victim for its protection
        self._now = 0.0
        self._enst: dict[str, float] | None = None  # next-run estimates, once per plan on demand
        self.swap_in = SwapInChoice(config.swap_in, config.swap_in_async_fraction, self.async_swap_in)
        self._async_blocks: dict[str, int] = {}  # blocks of each async copy in flight, for its statistics

    def reserved_blocks(self) -> int:
        """Free device blocks kept for a burst (FastServe §4.2); none outside proactive-swap."""
        return 0

    # ---- one plan ---------------------------------------------------------------------------
    def begin_plan(self, now: float) -> None:
        self._now, self._enst = now, None
        self.protection_blocked = False

    def end_plan(self, chosen: set[str], plan: StepPlan) -> None:
        """After the batch is chosen: background moves (proactive-swap)."""

    def on_arrival(self, req: Request) -> None:
        pass

    def next_run_estimates(self) -> dict[str, float]:
        """The policy's estimates, capped where the stall guard will run a started stream sooner."""
        if self._enst is None:
            enst = self.policy.next_run_estimates(self._now)
            if self.stall_guard.enabled:
                for rid, bound in self.stall_guard.next_run_bounds(self._now).items():
                    if bound < enst.get(rid, float("inf")):
                        enst[rid] = bound
            self._enst = enst
        return self._enst

    def make_room(self, need: int, lower: list[Request], chosen: set[str], holds_kv: bool, plan: StepPlan,
                  dropped: set[str], loads: bool, stalling: bool = False) -> bool:
        """Free device blocks by evicting lower-ranked requests' KV, the one that will run last
        first. A request that `loads` its KV (new, recomputing or on host) may not evict a
        protected job; one growing its resident KV may, or the pool could deadlock. A stream the
        stall guard protects (`stalling`) is not new work: it may evict in every mode."""
        if not holds_kv and not self.new_work_evicts and not stalling:
            return False
        kv = self.kv
        victims = [r for r in reversed(lower) if r.request_id not in chosen and kv.holds(r.request_id)
                   and not kv.in_flight(r.request_id) and not self.stall_guard.is_protected(r.request_id)]
        if len(victims) > 1:
            # FastServe §4.2: evict the job that will run last, not merely the lowest-ranked one:
            # a long-waiting job about to be promoted ranks low but runs soon.
            enst = self.next_run_estimates()
            victims.sort(key=lambda r: enst.get(r.request_id, 0.0), reverse=True)
        if loads:  # also for the stall guard's streams: under overload they would chase each other
            unprotected = [r for r in victims if not self.guard.is_protected(r.request_id)]
            if len(unprotected) < len(victims):
                self.protection_blocked = True
                victims = unprotected
        freeable = kv.num_free_device_blocks + kv.reclaimable([r.request_id for r in victims])
        if freeable < need:
            return False
        for victim in victims:
            if kv.num_free_device_blocks >= need:
                break
            self._evict(victim, plan, dropped)
        return True

    def _evict(self, victim: Request, plan: StepPlan, dropped: set[str]) -> None:
        self.drop(victim, plan)
        dropped.add(victim.request_id)

    def load(self, req: Request, on_host: bool, plan: StepPlan) -> bool:
        """A job chosen to run whose KV must be loaded (prefill, recompute or swap-in) is
        protected (sched/protection.py); one on host is swapped in. False: it runs once an
        asynchronous upload completes."""
        rid = req.request_id
        if on_host:
            num_blocks = len(self.kv.host_blocks(rid))
            self.guard.protect(rid, self._swap_seconds(num_blocks))
            sync = self._sync_for_guard(rid) or not self._async_swap_in(num_blocks)
            self.move(req, "in", plan, sync=sync)
            return sync
        self.guard.protect(rid, self.ctx.first_iteration_s(req.num_tokens - 1))
        return True

    def load_host_prefix(self, req: Request, num_blocks: int, plan: StepPlan) -> bool:
        """Copy a new request's cached prefix of `num_blocks` blocks from host: cheaper than
        its prefill (FastSwitch §3.3, SGLang HiCache). Sync or async as a swap-in (FastSwitch
        §3.2); False: the copy overlaps this step and the request runs once it landed."""
        rid = req.request_id
        sync = self._sync_for_guard(rid) or not self._async_swap_in(num_blocks)
        if not sync:
            self.kv.begin_transfer(rid)
        pairs = self.kv.load_host_prefix(rid)
        if sync:
            plan.swap_in.extend(pairs)
        else:
            plan.async_transfers.append(BlockTransfer(rid, "in", pairs))
            self._async_blocks[rid] = len(pairs)
        self.stats.record_swap(req.metrics, "in", len(pairs) * self.swap_block_bytes, len(copy_runs(pairs)))
        return sync

    def _sync_for_guard(self, rid: str) -> bool:
        """A stream the stall guard protects cannot wait a step for an overlapped copy: its
        deadline is near (unless the operator forced async copies with --swap-in async)."""
        return self.stall_guard.is_protected(rid) and self.swap_in.setting != "async"

    def _async_swap_in(self, num_blocks: int) -> bool:
        model_s = self._swap_seconds(num_blocks) if self.ctx.cost else None
        return self.swap_in.is_async(num_blocks, model_s)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Swap statistics of a finished step (FastSwitch §3.2): its sync copies and compute,
        and the async copies it reported."""
        sync_blocks = len(plan.swap_out) + len(plan.swap_in)
        self.swap_in.observe_copy(sync_blocks, result.transfer_seconds)
        if plan.num_tokens:
            self.swap_in.observe_step(result.step_seconds - result.transfer_seconds)
        for rid in result.transfers_done:
            num_blocks = self._async_blocks.pop(rid, 0)
            if rid in result.transfer_durations:
                self.swap_in.observe_copy(num_blocks, result.transfer_durations[rid])

    def offload_evicted(self, plan: StepPlan) -> None:
        """Cached device blocks this plan evicted are copied to host before it overwrites them
        (a prefix cache's host tier, SGLang HiCache)."""
        pairs = self.kv.take_offloads()
        if pairs:
            plan.swap_out.extend(pairs)
            self.stats.record_offload(len(pairs) * self.swap_block_bytes)

    def fast_forward_room(self, free_blocks: int) -> int:
        """Free blocks a repeated decode batch may grow into before something else would act."""
        return free_blocks

    # ---- bookkeeping, one place each --------------------------------------------------------
    def preempt(self, req: Request) -> None:
        if req.state is RequestState.RUNNING:
            req.state = RequestState.PREEMPTED
            self.stats.record_preemption(req.metrics, started=req.num_output_tokens > 0)

    def drop(self, req: Request, plan: StepPlan) -> None:
        """Discard the request's KV; it recomputes when it runs again."""
        self.kv.drop(req.request_id)
        self.stats.record_recompute(req.metrics, req.num_computed_tokens)
        req.num_computed_tokens = 0
        self.preempt(req)
        req.state = RequestState.WAITING
        plan.drop.append(req.request_id)

    def move(self, req: Request, direction: Direction, plan: StepPlan, *, sync: bool) -> None:
        """Swap a request's KV out to host or in to device; sync copies run before this step's
        compute, async ones overlap it (the request waits for transfers_done)."""
        kv, rid = self.kv, req.request_id
        if not sync:
            kv.begin_transfer(rid)
        pairs = kv.swap_out(rid) if direction == "out" else kv.swap_in(rid)
        if sync:
            (plan.swap_out if direction == "out" else plan.swap_in).extend(pairs)
        else:
            plan.async_transfers.append(BlockTransfer(rid, direction, pairs))
            self._async_blocks[rid] = len(pairs)
        self.stats.record_swap(req.metrics, direction, len(pairs) * self.swap_block_bytes, len(copy_runs(pairs)))
        if direction == "out":
            self.preempt(req)

    def _swap_seconds(self, num_blocks: int) -> float:
        """A copy's expected time: the cost model's, else the measured one (a real engine
        without a profile), so a swap-in's anti-thrashing protection is not void there."""
        cost = self.ctx.cost
        if cost:
            return cost.transfer_seconds(num_blocks * self.swap_block_bytes, 1)
        measured = self.swap_in.block_seconds
        return measured * num_blocks if measured is not None else 0.0


class Defer(Recompute):
    """`defer`: no preemption for memory: new work waits; a request that already holds KV may
    still evict (it must progress, or the pool deadlocks)."""

    mode = "defer"
    new_work_evicts = False


class ReactiveSwap(Recompute):
    """`reactive-swap`: a victim's KV is copied to host (recomputed only when host is full) and
    copied back, in the critical path, when it runs again (SchedulerConfig.swap_in may choose
    otherwise)."""

    mode = "reactive-swap"
    uses_host_tier = True

    def _evict(self, victim: Request, plan: StepPlan, dropped: set[str]) -> None:
        if self.kv.can_swap_out(victim.request_id):
            self.move(victim, "out", plan, sync=True)
            return
        self.stats.swap_fallbacks += 1  # host full: recompute instead, never an error
        super()._evict(victim, plan, dropped)
