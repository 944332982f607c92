"""Engine: add / abort / step / generate over a Scheduler and an Executor (docs/DESIGN.md, Data flow).

step() = plan = scheduler.schedule(now); result = executor.execute(plan);
         scheduler.update(plan, result, now); then detokenize and report.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenslice.clock import RealClock, VirtualClock
from tokenslice.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenslice.engine.detokenizer import IncrementalDetokenizer
from tokenslice.engine.step_trace import StepTraceWriter, step_record
from tokenslice.sim.executor import SimulatedExecutor, offload_block_bytes
from tokenslice.sim.pipeline import PipelinedSimulatedExecutor
from tokenslice.kv.manager import KVManager
from tokenslice.plan import StepPlan, StepResult
from tokenslice.request import (CompletionOutput, EngineRequest, InvalidRequestError, Request, RequestOutput,
                                SamplingParams, TokenLogprobs)
from tokenslice.predict.cost import CostModel, LoopShape, load_cost_model
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import PREEMPTION_STRATEGIES, make_policy
from tokenslice.sched.scheduler import Scheduler
from tokenslice.sched.snapshot import snapshot

log = logging.getLogger(__name__)


@dataclass
class StepTimings:
    """Wall seconds spent in each phase, summed over steps (engine overhead accounting)."""

    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0


class Executor(Protocol):
    """Runs plans (docs/DESIGN.md, Executor). `submit` hands over a plan and `poll` returns the
    oldest submitted plan's result, so several plans may be in flight (pipeline parallelism);
    `execute(plan)` is submit + poll, what the engine loop calls with one plan in flight."""

    def submit(self, plan: StepPlan) -> None: ...

    def poll(self) -> StepResult: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def close(self) -> None: ...


@dataclass
class _ModelSide:
    """The executor Engine.from_config built, and what the rest of the engine needs from it."""

    executor: Executor
    arch: Any  # model.arch.ArchConfig of the whole model
    tokenizer: Any
    name: str
    max_len: int
    blocks: int  # device KV blocks (on every rank)
    host_blocks: int
    swap_block_bytes: int  # one block on the host tier, whole model (all ranks)
    runner: Any = None  # model.runner.ModelRunner when the model runs in this process

    @staticmethod
    def start(config: EngineConfig, swapping: bool) -> _ModelSide:
        """The model in this process, or in one worker (process or Ray actor) per rank."""
        from tokenslice.model.loader import load_arch, model_tokenizer

        if config.parallel.multiproc or config.parallel.executor == "ray":
            from tokenslice.model.pp import PPStage
            from tokenslice.model.tp import TPShard

            par = config.parallel
            arch = load_arch(config.model)
            TPShard(arch, 0, par.tensor_parallel_size)  # refuses a size the heads do not fit
            PPStage.of(arch, 0, par.pipeline_parallel_size, par.stage_layers)  # ... or more stages than layers
            limit = arch.max_position_embeddings
            max_len = min(config.model.max_model_len or limit, limit)
            tokenizer = model_tokenizer(config.model, arch)
            sizes = dict(max_model_len=max_len, max_batch_size=config.scheduler.max_batch_size, host_tier=swapping,
                         pp_size=par.pipeline_parallel_size, pp_layers=par.stage_layers)
            if par.executor == "ray":
                from tokenslice.exec.ray_executor import RayExecutor

                ex: Any = RayExecutor(config.model, config.cache, par.tensor_parallel_size, address=par.ray_address,
                                      **sizes)
            else:
                from tokenslice.exec.multiproc import MultiprocExecutor

                ex = MultiprocExecutor(config.model, config.cache, par.tensor_parallel_size, **sizes)
            return _ModelSide(ex, arch, tokenizer, str(Path(config.model.model)), max_len, ex.num_blocks,
                              ex.num_host_blocks, ex.host_block_bytes)
        from tokenslice.exec.local import LocalExecutor
        from tokenslice.model.loader import load_model
        from tokenslice.model.runner import ModelRunner, num_host_kv_blocks, num_kv_blocks

        loaded = load_model(config.model)
        limit = loaded.arch.max_position_embeddings
        max_len = min(config.model.max_model_len or limit, limit)
        blocks = num_kv_blocks(config.cache, loaded, max_len, config.scheduler.max_batch_size)
        host_blocks = num_host_kv_blocks(config.cache, loaded) if swapping else 0
        runner = ModelRunner(loaded, blocks, config.cache.block_size, config.model.seed,
                             num_host_blocks=host_blocks, offload_dtype=config.cache.offload_dtype,
                             persistent_batch=config.model.persistent_batch, compile=bool(config.model.compile),
                             cuda_graphs=config.model.cuda_graphs, max_batch_size=config.scheduler.max_batch_size,
                             max_model_len=max_len)
        return _ModelSide(LocalExecutor(runner), loaded.arch, loaded.tokenizer, loaded.name, max_len, blocks,
                          host_blocks, runner.host_block_bytes, runner)


class TraceItem(Protocol):
    """One request of a workload trace (bench.workloads.WorkloadRequest has these fields)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int


class PriorityUpdates(Protocol):
    """Priority changes during a trace replay (FastSwitch §4's patterns; bench.workloads has one).

    `initial(item)` is a request's priority at arrival; every `period` engine steps (1/f),
    `at_iteration(steps so far, live request ids)` returns the new priority of each request to change.
    """

    period: int

    def initial(self, item: Any) -> int: ...

    def at_iteration(self, iteration: int, live_request_ids: list[str]) -> dict[str, int]: ...


def tokenize_prompt(tokenizer: Any | None, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids, as the engine adds them (text gets the tokenizer's special tokens)."""
    if isinstance(prompt, str):
        if not prompt:  # checked before tokenizing: a BOS token would hide it
            raise InvalidRequestError("prompt is empty", "prompt")
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, tokenizer: Any | None,
                 clock: RealClock | VirtualClock, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], model_name: str = "", max_in_flight: int = 1) -> None:
        """`max_in_flight`: plans the executor may hold at once (its pipeline stages)."""
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.timings = StepTimings()
        # Simulator only: repeat unchanged decode batches in bulk between events (exact).
        self.fast_forward = False
        self.max_fast_forward_steps = 4096
        # Simulator only: a cost model whose loop terms (fitted on step traces) advance the clock
        # besides each forward pass, as a real engine's scheduling and bookkeeping take time.
        self.loop_cost: CostModel | None = None
        self._arrivals = 0  # requests added since the last step
        self.length_predictor: Any | None = None  # predict.length.LengthPredictor, for srpt-predicted
        self._prompt_text: dict[str, str] = {}
        # Logprobs computed since a request's last output (sampled token, prompt positions).
        self._logprobs: dict[str, TokenLogprobs] = {}
        self._prompt_logprobs: dict[str, TokenLogprobs] = {}
        # Off in the engine-core process: the API server detokenizes and applies stop strings there.
        self.detokenize = True
        self.step_trace: StepTraceWriter | None = None  # --step-trace: one record per real step
        self._step_began = 0.0  # simulator: virtual time the last executed step began (its trace start)
        self.max_in_flight = max_in_flight
        self._pipe: deque[StepPlan] = deque()  # submitted, not yet polled (oldest first)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        config.validate()
        swapping = PREEMPTION_STRATEGIES[config.scheduler.preemption].uses_host_tier
        side = _ModelSide.start(config, swapping)
        try:  # the workers must not outlive a failed start
            blocks, host_blocks = side.blocks, side.host_blocks
            if swapping and host_blocks == 0:
                log.warning("preemption %s without host KV space (--swap-space-gb 0): every eviction recomputes",
                            config.scheduler.preemption)
            log.info("model %s (%s, tensor-parallel size %d, %d pipeline stages): %d KV blocks of %d tokens, "
                     "%d host blocks", side.name, side.arch.architecture, config.parallel.tensor_parallel_size,
                     config.parallel.pipeline_parallel_size, blocks, config.cache.block_size, host_blocks)
            # Block groups (FastSwitch §3.1) so a swap is a few large copies.
            kv = KVManager(config.cache.block_size, blocks, host_blocks,
                           contiguous=swapping and config.cache.block_groups,
                           prefix_caching=config.cache.enable_prefix_caching)
            cost = load_cost_model(config.profile) if config.profile else None
            ctx = PolicyContext(config.scheduler, cost)
            scheduler = Scheduler(config.scheduler, make_policy(config.scheduler.policy, ctx), kv, ctx,
                                  swap_block_bytes=side.swap_block_bytes)
            eos = side.tokenizer.eos_token_id if side.tokenizer.eos_token_id is not None else side.arch.eos_token_id
            eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
            engine = cls(scheduler, side.executor, tokenizer=side.tokenizer, clock=RealClock(),
                         max_model_len=side.max_len, vocab_size=side.arch.vocab_size, eos_token_ids=eos_ids,
                         model_name=side.name, max_in_flight=config.parallel.pipeline_parallel_size)
            if config.step_trace:
                engine.step_trace = StepTraceWriter(config.step_trace)
            if side.runner is not None:  # the model in this process (tests and benchmarks read it)
                engine.runner = side.runner
            if config.scheduler.length_predictor:
                from tokenslice.predict.length import LengthPredictor

                engine.length_predictor = LengthPredictor.load(
                    config.scheduler.length_predictor, store_text=config.scheduler.length_predictor_store_text)
            return engine
        except BaseException:
            side.executor.close()
            raise

    def close(self) -> None:
        """Release executor resources (transfer threads) and the length predictor. Idempotent."""
        self.executor.close()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.length_predictor is not None:
            self.length_predictor.close()
            self.length_predictor = None

    def _predict_length(self, req: Request, text: str | None) -> None:
        """ALISE §3.1: predict the output length at arrival; learn the real one at finish."""
        if text is None:
            text = self.tokenizer.decode(req.prompt_token_ids)
        self._prompt_text[req.request_id] = text
        if req.predicted_output_tokens is None:
            req.predicted_output_tokens = max(1, round(self.length_predictor.predict_one(text)))

    def _observe_lengths(self, finished: list[Request]) -> None:
        for req in finished:
            text = self._prompt_text.pop(req.request_id, None)
            if text is not None and req.finish_reason in ("stop", "length"):
                # Cut off by max_tokens: only a lower bound on the length it wanted (censored).
                self.length_predictor.observe(text, req.num_output_tokens, censored=req.finish_reason == "length")

    @classmethod
    def simulated(cls, config: SchedulerConfig, cost: CostModel, *, kv_cache_blocks: int,
                  block_size: int = 16, max_model_len: int = 1 << 30, host_kv_blocks: int = 0,
                  offload_dtype: str = "auto",
                  enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                  block_groups: bool = CacheConfig.block_groups, max_in_flight: int | None = None,
                  policy_cost: CostModel | None = None) -> Engine:
        """The simulator (docs/DESIGN.md): the same scheduler and policies on a virtual clock, with
        iteration times (and swap copy times) from the cost model instead of a model. A cost
        model with pipeline stages (`:ppM`) gets the pipelined executor, `max_in_flight` batches
        in the pipe (default one per stage). `policy_cost` is the cost model the policies see
        (default: `cost`), e.g. the profile a real server's policies were given, when the clock
        runs on another one."""
        swapping = PREEMPTION_STRATEGIES[config.preemption].uses_host_tier
        kv = KVManager(block_size, kv_cache_blocks, host_kv_blocks if swapping else 0,
                       contiguous=swapping and block_groups, prefix_caching=enable_prefix_caching)
        ctx = PolicyContext(config, policy_cost or cost)
        policy = make_policy(config.policy, ctx)
        clock = VirtualClock()
        block_bytes = offload_block_bytes(block_size, cost.kv_bytes_per_token, offload_dtype)
        scheduler = Scheduler(config, policy, kv, ctx, swap_block_bytes=block_bytes)
        pipelined = cost.pipeline_parallel > 1
        executor = (PipelinedSimulatedExecutor(cost, clock, block_bytes, max_in_flight) if pipelined
                    else SimulatedExecutor(cost, clock, block_bytes))
        engine = cls(scheduler, executor, tokenizer=None, clock=clock, max_model_len=max_model_len,
                     vocab_size=1 << 31, eos_token_ids=[], model_name=cost.name,
                     max_in_flight=executor.max_in_flight if pipelined else 1)
        engine.fast_forward = not pipelined  # bulk repeats assume one batch at a time
        if cost.has_loop_cost:  # pipelined: the loop's time between a batch's return and the next submit
            engine.loop_cost = cost
        return engine

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    user: str | None = None, priority: int = 0,
                    expected_output_tokens: int | None = None,
                    predicted_output_tokens: int | None = None, eos_after: int | None = None) -> Request:
        """Tokenize `prompt` (text or token ids) and add it (see `add`)."""
        params = params or SamplingParams()
        params.validate()  # before tokenizing: a bad setting is the clearer error
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        new = EngineRequest(rid, self.tokenize(prompt), params, arrival_time, user, priority,
                            expected_output_tokens, predicted_output_tokens, eos_after)
        return self.add(new, prompt if isinstance(prompt, str) else None)

    def add(self, new: EngineRequest, prompt_text: str | None = None) -> Request:
        """Validate and admit a request; raises InvalidRequestError for one the engine refuses.
        `prompt_text` spares the length predictor a detokenization."""
        params = new.params
        params.validate()
        params.check_vocab(self.vocab_size)
        self._check_priority(new.priority)
        ids = list(new.prompt_token_ids)
        self._check_prompt(ids)
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # Extra end-of-sequence ids (Llama 3 lists several) stop like stop tokens.
            params = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + self.eos_token_ids[1:])
        now = self.clock.now()
        req = Request(new.request_id, ids, params, now if new.arrival_time is None else new.arrival_time,
                      user=new.user, priority=new.priority, expected_output_tokens=new.expected_output_tokens,
                      predicted_output_tokens=new.predicted_output_tokens,
                      eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None)
        req.max_total_tokens = self.max_model_len
        req.eos_after = new.eos_after
        req.cache_prefix = new.cache_prefix
        req.prefix_leader = new.prefix_leader
        if self.length_predictor is not None and self.tokenizer is not None:
            self._predict_length(req, prompt_text)
        self.scheduler.add(req, now)
        self._arrivals += 1
        if self.tokenizer is not None and self.detokenize:
            self._detok[req.request_id] = IncrementalDetokenizer.for_request(self.tokenizer, ids, params)
        return req

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                f"which must also leave room for at least one generated token", "prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        kv = self.scheduler.kv
        if kv.blocks_for_tokens(len(ids) + 1) > kv.device.num_blocks:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the KV cache holds only {kv.capacity_tokens}", "prompt")

    def _check_priority(self, priority: int) -> None:
        # As vLLM: a priority the policy would ignore is an error, not a silent no-op.
        policy = self.scheduler.policy
        if priority != 0 and not policy.uses_priority:
            raise InvalidRequestError(
                f"priority {priority} needs a policy that schedules by priority (--policy priority); "
                f"this engine runs {policy.name!r}", "priority")

    def set_priority(self, request_id: str, priority: int) -> bool:
        """Change a live request's priority (lower runs first); it takes effect at the next step.
        Returns False if the request is not live; raises InvalidRequestError (param "priority")
        for a non-zero priority under a policy that does not use priorities."""
        self._check_priority(priority)
        return self.scheduler.set_priority(request_id, priority, self.clock.now())

    def abort_request(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        return self.scheduler.abort(request_id, self.clock.now()) is not None

    def has_unfinished(self) -> bool:
        """Live requests, or plans still in flight (of requests aborted meanwhile)."""
        return self.scheduler.has_unfinished() or bool(self._pipe)

    def state(self) -> dict[str, Any]:
        """The scheduler as plain data for a live view (sched/snapshot.py): ids and counts, no text."""
        return snapshot(self.scheduler, self.clock.now())

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; an output for every request that got a token or finished."""
        produced, finished = self._advance()
        outputs = [self._output(req, req.output_token_ids[-1:]) for req in produced]
        reported = {req.request_id for req in produced}
        for req in finished:
            if req.request_id not in reported:  # finished without a new token (abort, stall)
                outputs.append(self._output(req, []))
        return outputs

    def _advance(self, horizon: float = float("inf"), max_steps: int | None = None
                 ) -> tuple[list[Request], list[Request]]:
        """schedule -> execute -> update; returns (requests with a new token, requests finished).

        With fast_forward (simulator), a decode-only batch then repeats in bulk until the next
        event: a finish, a policy change, KV growth that no longer fits, `horizon` (the next
        arrival) or `max_steps` steps (the next priority update). `produced` then lists each
        request once."""
        if self.max_in_flight > 1:
            return self._advance_pipelined(horizon)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.clock.now())
        t1 = time.perf_counter()
        if self.fast_forward and self.clock.now() < horizon:
            ran = self._repeat(plan, horizon, max_steps)
            if ran is not None:
                finished = self.scheduler.take_finished()
                self.timings.schedule_s += t1 - t0
                self.timings.update_s += time.perf_counter() - t1
                return ran, finished
        counts = self._trace_counts()
        self._step_began = self.clock.now()
        result = self.executor.execute(plan)
        self.clock.advance(result.step_seconds + self._loop_seconds(len(result.sampled)))
        return self._apply(plan, result, t0, t1, counts)

    def _advance_pipelined(self, horizon: float) -> tuple[list[Request], list[Request]]:
        """Pipeline stages (FastServe §4.3): submit batches of pending jobs while the pipe has
        room (the scheduler leaves out jobs whose token is in it), then take back the oldest
        batch: its tokens, finishes, and the policy's charge (a job whose quantum ran out in
        flight is demoted now). In the simulator a request arriving while the pipe has room is
        admitted before the oldest batch returns, as a real loop would."""
        ex, sched = self.executor, self.scheduler
        t0 = time.perf_counter()
        while len(self._pipe) < self.max_in_flight:
            plan = sched.schedule(self.clock.now())
            if self._pipe and not plan.has_work:
                sched.keep_released(plan)
                break
            ex.submit(plan)
            self._pipe.append(plan)
            if not plan.has_work:
                break  # nothing could start: wait for what the executor is doing
        t1 = time.perf_counter()
        counts = self._trace_counts()
        if isinstance(ex, PipelinedSimulatedExecutor) and len(self._pipe) < self.max_in_flight:
            ready = ex.next_ready()
            if ready is not None and horizon < ready:
                self.clock.advance_to(horizon)
                self.timings.schedule_s += t1 - t0
                return [], []
        result = ex.poll()
        plan = self._pipe.popleft()
        self._step_began = self.clock.now()  # pipelined: when the loop began waiting for this batch
        if result.done_at is not None:
            self.clock.advance_to(result.done_at)
        self.clock.advance(self._loop_seconds(len(result.sampled)))  # the driver's own time, between batches
        return self._apply(plan, result, t0, t1, counts)

    def _apply(self, plan: StepPlan, result: StepResult, t0: float, t1: float, counts: tuple[int, int, int]
               ) -> tuple[list[Request], list[Request]]:
        """A plan's result into the scheduler (tokens, finishes), the detokenizers, the length
        predictor and the step trace; `t0`/`t1`: when its scheduling began and ended, `counts`:
        the step trace's request counts after it."""
        t2 = time.perf_counter()
        self.num_steps += 1
        now = self.clock.now()
        # A request aborted while its plan was in flight (pipeline stages) gets no output: drop
        # its late logprobs rather than keep them forever.
        live = {rid for rid in (*result.logprobs, *result.prompt_logprobs) if rid in self.scheduler.requests}
        produced = self.scheduler.update(plan, result, now)
        for pending, new in ((self._logprobs, result.logprobs), (self._prompt_logprobs, result.prompt_logprobs)):
            for rid, lp in new.items():
                if rid in live:
                    pending.setdefault(rid, TokenLogprobs()).extend(lp)
        if self._detok:
            for req in produced:
                det = self._detok.get(req.request_id)
                if det is not None:
                    det.add_step(req.output_token_ids[-1:], req.finish_reason)
                    if det.stopped and not req.is_finished:
                        self.scheduler.finish(req.request_id, "stop", now)
        finished = self.scheduler.take_finished()
        if self.length_predictor is not None and finished:
            self._observe_lengths(finished)
        t3 = time.perf_counter()
        self.timings.schedule_s += t1 - t0
        self.timings.execute_s += t2 - t1
        self.timings.update_s += t3 - t2
        if self.step_trace is not None:
            self._trace_step(t0, (t1 - t0, t2 - t1, t3 - t2), plan, result, counts, len(finished))
        return produced, finished

    def _trace_counts(self) -> tuple[int, int, int]:
        """(running, waiting, preempted) requests as scheduling left them, where the simulator sees
        them; only counted for a step trace."""
        if self.step_trace is None:
            return 0, 0, 0
        sched = self.scheduler
        return sched.num_running, sched.num_waiting, sched.num_preempted

    def _trace_step(self, t0: float, times: tuple[float, float, float], plan: StepPlan, result: StepResult,
                    counts: tuple[int, int, int], finished: int) -> None:
        assert self.step_trace is not None
        # The simulator's steps start on its virtual clock.
        start = self._step_began if isinstance(self.clock, VirtualClock) else self.step_trace.wall_start(t0)
        self.step_trace.write(step_record(self.num_steps, start, plan, result, counts, times, finished))

    def _loop_seconds(self, sampled: int) -> float:
        """Simulator: the loop's own time this step (0.0 without loop terms); takes the arrivals
        since the last step into it."""
        arrivals, self._arrivals = self._arrivals, 0
        if self.loop_cost is None:
            return 0.0
        return self.loop_cost.loop_seconds(LoopShape(len(self.scheduler.requests), sampled, arrivals))

    def _repeat(self, plan: StepPlan, horizon: float, max_steps: int | None = None) -> list[Request] | None:
        """Run a just-scheduled decode-only plan for as many steps as it provably stays the
        plan (at least 2, at most `max_steps`), in bulk; None when that is not the case."""
        sched, sim = self.scheduler, self.executor
        if not isinstance(sim, SimulatedExecutor):
            raise TypeError("fast_forward needs the simulator's executor (Engine.simulated)")
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
                loop_s=loop_s)
            durations += more_d
            ends += more_e
            # Stop at the first step that reaches the next arrival, as step-by-step replay would.
            limit = min(window, bisect.bisect_left(ends, horizon) + 1)
            limit = sched.policy.stable_steps(reqs, durations[:limit], ends[:limit])
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

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        done = req.is_finished
        det = self._detok.pop(req.request_id, None) if done else self._detok.get(req.request_id)
        if det is not None and done:
            det.add([], final=True)  # release bytes held back waiting for a character to complete
        rid = req.request_id
        out = RequestOutput(rid, new_ids, det.delta(done) if det else "", done,
                            req.finish_reason, req.num_prompt_tokens, req.num_output_tokens, req.metrics, req.user)
        out.prompt_logprobs = self._prompt_logprobs.pop(rid, None)
        if req.params.logprobs is not None:
            out.logprobs = self._logprobs.pop(rid, None)
            if out.logprobs is not None:
                req.cumulative_logprob += sum(out.logprobs.logprobs)
            out.cumulative_logprob = req.cumulative_logprob
        return out

    def replay(self, trace: list[TraceItem], *, on_finish: Any = None,
               priority_updates: PriorityUpdates | None = None,
               on_advance: Callable[[float], None] | None = None, max_tokens_is_output: bool = False
               ) -> list[Request]:
        """Run a workload trace: each request arrives at its time (clock-relative to the start)
        and generates exactly its output length, then stops as at an EOS (`Request.eos_after`);
        max_tokens is the context left, as a client that does not know the answer's length sends.
        With `max_tokens_is_output`, max_tokens is the output length instead, as a load client
        forcing lengths over HTTP sends it (bench/client.py); the policies that read it (a
        prediction is capped at max_tokens) then see what the real server saw.
        Returns the requests, finished, in trace order.

        On a VirtualClock idle gaps are skipped; on a real clock the loop sleeps until the next
        arrival. `on_finish(req)` is called as each request finishes.

        `priority_updates` (FastSwitch §4) sets each request's priority at arrival, and after every
        `period` engine steps changes the live requests' priorities with `set_priority` before the
        next step; a fast-forwarded window ends at each update point, so the result is the same
        with fast_forward on or off. `on_advance(now)` is called after every step (or
        fast-forwarded window), e.g. to record the scheduler's state; it must not change it.
        """
        items = sorted(trace, key=lambda t: t.arrival_time)
        start = self.clock.now()
        reqs: dict[str, Request] = {}
        # A trace's priority labels and updates drive only policies that use them; the others
        # replay it unprioritized (a sweep compares them on the same trace).
        if not self.scheduler.policy.uses_priority:
            priority_updates = None
        prioritized = self.scheduler.policy.uses_priority
        period = priority_updates.period if priority_updates is not None else 0
        next_update = period
        i = 0
        while i < len(items) or self.has_unfinished():
            now = self.clock.now()
            while i < len(items) and start + items[i].arrival_time <= now:
                item = items[i]
                real = getattr(item, "prompt_token_ids", None)
                ids = real or [0] * max(1, item.prompt_len)
                cap = item.output_len if max_tokens_is_output else self.max_model_len - len(ids)
                params = SamplingParams(max_tokens=max(1, cap), temperature=0.0, ignore_eos=True)
                if priority_updates is not None:
                    priority = priority_updates.initial(item)
                else:
                    priority = (getattr(item, "priority", 0) or 0) if prioritized else 0
                reqs[item.request_id] = self.add(EngineRequest(
                    item.request_id, ids, params, start + item.arrival_time, getattr(item, "user", None), priority,
                    expected_output_tokens=item.output_len,
                    predicted_output_tokens=getattr(item, "predicted_output_tokens", None),
                    eos_after=max(1, item.output_len), cache_prefix=bool(real)))  # placeholders share nothing
                i += 1
            if not self.has_unfinished():
                self._wait_until(start + items[i].arrival_time)
                continue
            if priority_updates is not None and self.num_steps >= next_update:
                changes = priority_updates.at_iteration(self.num_steps, list(self.scheduler.requests))
                for rid, priority in changes.items():
                    self.set_priority(rid, priority)
                next_update = (self.num_steps // period + 1) * period
            horizon = start + items[i].arrival_time if i < len(items) else float("inf")
            max_steps = next_update - self.num_steps if period else None
            _, finished = self._advance(horizon, max_steps)
            if on_advance is not None:
                on_advance(self.clock.now())
            for req in finished:
                self._detok.pop(req.request_id, None)
                if on_finish is not None:
                    on_finish(req)
        return [reqs[t.request_id] for t in trace]

    def _wait_until(self, t: float) -> None:
        if isinstance(self.clock, VirtualClock):
            self.clock.advance_to(t)
        else:
            time.sleep(max(0.0, t - self.clock.now()))

    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run prompts to completion (offline use); results in prompt order."""
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        results = {r.request_id: CompletionOutput(r.request_id, p if isinstance(p, str) else None, r.prompt_token_ids,
                                                  "", [], None, r.metrics)
                   for r, p in zip(reqs, prompts, strict=True)}
        while any(not r.is_finished for r in reqs):
            for out in self.step():
                res = results.get(out.request_id)
                if res is not None:
                    res.text += out.text_delta
                    res.logprobs = _joined(res.logprobs, out.logprobs)
                    res.prompt_logprobs = _joined(res.prompt_logprobs, out.prompt_logprobs)
                    res.cumulative_logprob = out.cumulative_logprob
        for r in reqs:
            res = results[r.request_id]
            res.token_ids, res.finish_reason = list(r.output_token_ids), r.finish_reason
        return list(results.values())


def _joined(acc: TokenLogprobs | None, part: TokenLogprobs | None) -> TokenLogprobs | None:
    if part is None:
        return acc
    acc = acc if acc is not None else TokenLogprobs()
    acc.extend(part)
    return acc
