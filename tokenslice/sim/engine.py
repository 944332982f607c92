"""The simulator's engine (docs/DESIGN.md, Simulator): the same Engine loop and Scheduler on a
virtual clock, with iteration (and swap copy) times from a cost model instead of a model.

It overrides only how time passes: each step advances the clock by the cost model's time plus
the loop's own (fitted on step traces), and an unchanged decode batch repeats in bulk until the
next event (fast-forward; exact: the same tokens, times and finishes as step-by-step).
"""
from __future__ import annotations

import bisect
from typing import Any

from tokenslice.config import CacheConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import CostModel, LoopShape
from tokenslice.request import EngineRequest, Request
from tokenslice.sched.scheduler import build_scheduler
from tokenslice.sim.clock import VirtualClock
from tokenslice.sim.executor import SimulatedExecutor, offload_block_bytes
from tokenslice.sim.pipeline import PipelinedSimulatedExecutor


class SimulatedEngine(Engine):
    clock: VirtualClock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Repeat unchanged decode batches in bulk between events (exact).
        self.fast_forward = False
        self.max_fast_forward_steps = 4096
        # A cost model whose loop terms (fitted on step traces) advance the clock besides each
        # forward pass, as a real engine's scheduling and bookkeeping take time.
        self.loop_cost: CostModel | None = None
        # Async scheduling's timing (the real engine's --async-scheduling): the loop's own time
        # runs while the device computes, so a step takes the longer of the two, not their sum.
        # Only time is modelled; the policies still see each step's tokens before the next plan.
        self.overlap_loop = False
        self._arrivals = 0  # requests added since the last step
        self._step_began = 0.0  # when the last executed step began (pipelined: its wait began); traced

    def add(self, new: EngineRequest) -> Request:
        req = super().add(new)
        self._arrivals += 1  # the loop cost of the next step grows with them
        return req

    def _executed(self, result: StepResult) -> None:
        self._step_began = self.clock.now()  # the executors only read the clock: the step starts now
        if self.max_in_flight == 1:
            loop = self._loop_seconds(len(result.sampled))
            self.clock.advance(max(result.step_seconds, loop) if self.overlap_loop else result.step_seconds + loop)
            return
        if result.done_at is not None:  # pipelined: the batch came back at its own time
            self.clock.advance_to(result.done_at)
        self.clock.advance(self._loop_seconds(len(result.sampled)))  # the driver's own time, between batches

    def _wait_for_batch(self, horizon: float) -> bool:
        """A request arriving while the pipe has room is admitted before the oldest batch
        returns, as a real loop would."""
        ex = self.executor
        if isinstance(ex, PipelinedSimulatedExecutor) and len(self._pipe) < self.max_in_flight:
            ready = ex.next_ready()
            if ready is not None and horizon < ready:
                self.clock.advance_to(horizon)
                return False
        return True

    def _step_start(self, perf_start: float) -> float:
        return self._step_began

    def _loop_seconds(self, sampled: int) -> float:
        """The loop's own time this step (0.0 without loop terms); takes the arrivals since the
        last step into it."""
        arrivals, self._arrivals = self._arrivals, 0
        if self.loop_cost is None:
            return 0.0
        return self.loop_cost.loop_seconds(LoopShape(len(self.scheduler.requests), sampled, arrivals))

    def _fast_forward(self, plan: StepPlan, horizon: float, max_steps: int | None) -> list[Request] | None:
        """Run a just-scheduled decode-only plan for as many steps as it provably stays the
        plan (at least 2, at most `max_steps`, ending at the first step that reaches `horizon`),
        in bulk; None when that is not the case: a finish, a policy change, KV growth that no
        longer fits."""
        if not self.fast_forward or self.clock.now() >= horizon:
            return None
        sched, sim = self.scheduler, self.executor
        if not isinstance(sim, SimulatedExecutor):
            raise TypeError("fast_forward needs the simulator's executor")
        reqs = sched.repeatable_steps(plan)
        if not reqs:
            return None
        cap = self.max_fast_forward_steps if max_steps is None else min(self.max_fast_forward_steps, max_steps)
        k = sched.max_repeat(reqs, cap)
        if k < 2 or (self.loop_cost is not None and self._arrivals):
            return None  # arrivals cost the next step alone: it runs by itself
        loop_s = self._loop_seconds(len(reqs))
        # Grow the window in doubling chunks: most runs end early (an arrival, a demotion), and
        # durations past that point would be wasted work.
        durations: list[float] = []
        ends: list[float] = []
        window = min(k, 16)
        while True:
            more_d, more_e = sim.repeat_decode_times(
                reqs, window - len(durations), ends[-1] if ends else self.clock.now(), first_step=len(durations),
                loop_s=loop_s, overlap=self.overlap_loop)
            durations += more_d
            ends += more_e
            # Stop at the first step that reaches the next arrival, as step-by-step replay would.
            limit = min(window, bisect.bisect_left(ends, horizon) + 1)
            limit = sched.stable_steps(reqs, durations[:limit], ends[:limit])
            if limit < window or window == k:
                break
            window = min(k, 2 * window)
        k = limit
        if k < 2:
            return None
        sched.repeat_decode(reqs, durations[:k], ends[:k], sim.token)
        self.clock.advance_to(ends[k - 1])
        self.num_steps += k
        return reqs


def simulated_engine(config: SchedulerConfig, cost: CostModel, *, kv_cache_blocks: int,
                     block_size: int = 16, max_model_len: int = 1 << 30, host_kv_blocks: int = 0,
                     offload_dtype: str = "auto",
                     enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                     block_groups: bool = CacheConfig.block_groups, max_in_flight: int | None = None,
                     policy_cost: CostModel | None = None,
                     engine_class: type[SimulatedEngine] = SimulatedEngine,
                     async_scheduling: bool = False) -> SimulatedEngine:
    """A simulated engine (of `engine_class`, a subclass that observes it, if given). A cost model with pipeline stages (`:ppM`) gets the pipelined
    executor, `max_in_flight` batches in the pipe (default one per stage). `policy_cost` is the
    cost model the policies see (default: `cost`), e.g. the profile a real server's policies
    were given, when the clock runs on another one."""
    clock = VirtualClock()
    block_bytes = offload_block_bytes(block_size, cost.kv_bytes_per_token, offload_dtype)
    scheduler = build_scheduler(config, policy_cost or cost, block_size=block_size, device_blocks=kv_cache_blocks,
                                host_blocks=host_kv_blocks, block_groups=block_groups,
                                prefix_caching=enable_prefix_caching, swap_block_bytes=block_bytes)
    pipelined = cost.pipeline_parallel > 1
    executor = (PipelinedSimulatedExecutor(cost, clock, block_bytes, max_in_flight) if pipelined
                else SimulatedExecutor(cost, clock, block_bytes))
    engine = engine_class(scheduler, executor, tokenizer=None, clock=clock, max_model_len=max_model_len,
                          vocab_size=1 << 31, eos_token_ids=[], model_name=cost.name,
                          max_in_flight=executor.max_in_flight if pipelined else 1)
    engine.fast_forward = not pipelined  # bulk repeats assume one batch at a time
    if async_scheduling and pipelined:
        raise ValueError("async_scheduling needs one pipeline stage (a cost model without :ppM)")
    engine.overlap_loop = async_scheduling
    if cost.has_loop_cost:  # pipelined: the loop's time between a batch's return and the next submit
        engine.loop_cost = cost
    return engine
