"""Engine: the serving loop, add / abort / step / generate over a Scheduler and an Executor
(docs/DESIGN.md, Data flow).

step() = plan = scheduler.schedule(now); result = executor.execute(plan);
         scheduler.update(plan, result, now); then the outputs (engine/output.py).

The simulator (sim/engine.py) runs this same loop on a virtual clock: it overrides only the
hooks that say how time passes (`_fast_forward`, `_executed`, `_wait_for_batch`, `_step_start`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tokenslice.clock import RealClock
from tokenslice.config import EngineConfig
from tokenslice.engine.grammar_queue import GrammarQueue
from tokenslice.engine.output import OutputProcessor, joined_logprobs
from tokenslice.engine.protocol import tokenize_prompt
from tokenslice.engine.request_checks import check_priority, check_prompt
from tokenslice.engine.step_trace import StepTraceWriter, step_record
from tokenslice.exec.base import Executor
from tokenslice.exec.factory import start_model
from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import load_cost_model
from tokenslice.predict.online import OnlineLengthPredictor, auto_predictor_dir
from tokenslice.request import (CompletionOutput, EngineRequest, InvalidRequestError, Request, RequestOutput,
                                SamplingParams, TokenLogprobs, prompts_with_params)
from tokenslice.sched.registry import PREEMPTION_STRATEGIES, make_policy
from tokenslice.sched.scheduler import Scheduler, build_scheduler
from tokenslice.sched.snapshot import snapshot
from tokenslice.sched.speculative import SpeculativeSRPTPolicy

log = logging.getLogger(__name__)


def _grammars(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """model.grammar.Grammars for the served model (xgrammar loads here, at the first structured request)."""
    from tokenslice.model.grammar import Grammars

    return Grammars(tokenizer, vocab_size, eos_token_ids)


@dataclass
class StepTimings:
    """Wall seconds spent in each phase, summed over steps (engine overhead accounting)."""

    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, tokenizer: Any | None,
                 clock: Any, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], model_name: str = "", max_in_flight: int = 1,
                 async_scheduling: bool = False) -> None:
        """`clock`: has now() and advance(seconds) (clock.RealClock, or the simulator's);
        `max_in_flight`: plans the executor may hold at once (its pipeline stages);
        `async_scheduling`: plan each step while the executor runs the one before (one stage only)."""
        if async_scheduling and max_in_flight > 1:
            raise ValueError("async scheduling needs one pipeline stage: a stage cannot fill in a token "
                             "that only the last stage samples")
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name
        self._ids = itertools.count()
        self.num_steps = 0
        self.timings = StepTimings()
        self.lengths: OnlineLengthPredictor | None = None  # for srpt-predicted
        self.matmul_params = 0  # weights each token multiplies (ArchConfig.matmul_params); 0: unknown
        # Logprobs computed since a request's last output (sampled token, prompt positions).
        self._logprobs: dict[str, TokenLogprobs] = {}
        self._prompt_logprobs: dict[str, TokenLogprobs] = {}
        # Text and stop strings of this process's outputs; off in the engine clients, which
        # run their own processor (in the event loop, or in the API server's process).
        self.detokenize = True
        self._text = OutputProcessor(tokenizer, self._stop) if tokenizer is not None else None
        self.step_trace: StepTraceWriter | None = None  # --step-trace: one record per real step
        self.stages = max_in_flight  # pipeline stages: plans in flight without async scheduling
        self._pipe: deque[StepPlan] = deque()  # submitted, not yet polled (oldest first)
        self._plan_ahead(async_scheduling)
        # Structured outputs: grammars compile here before their request joins the scheduler
        # (None: constrained requests are admitted as they come, as the simulator does).
        self.grammar_queue: GrammarQueue | None = None
        self._failed: dict[str, str] = {}  # requests that ended before they ran, and why (take_failed)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        config.validate()
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs one engine process per replica (`tokenslice serve`, "
                             "LLM); an Engine is one replica")
        swapping = PREEMPTION_STRATEGIES[config.scheduler.preemption].uses_host_tier
        side = start_model(config, swapping)
        try:  # the workers must not outlive a failed start
            if swapping and side.host_blocks == 0:
                log.warning("preemption %s without host KV space (--swap-space-gb 0): every eviction recomputes",
                            config.scheduler.preemption)
            log.info("model %s (%s, tensor-parallel size %d, %d pipeline stages): %d KV blocks of %d tokens, "
                     "%d host blocks", side.name, side.arch.architecture, config.parallel.tensor_parallel_size,
                     config.parallel.pipeline_parallel_size, side.blocks, config.cache.block_size, side.host_blocks)
            scheduler = build_scheduler(
                config.scheduler, load_cost_model(config.profile) if config.profile else None,
                block_size=config.cache.block_size, device_blocks=side.blocks, host_blocks=side.host_blocks,
                block_groups=config.cache.block_groups, prefix_caching=config.cache.enable_prefix_caching,
                swap_block_bytes=side.swap_block_bytes)
            engine = cls(scheduler, side.executor, tokenizer=side.tokenizer, clock=RealClock(),
                         max_model_len=side.max_len, vocab_size=side.arch.vocab_size,
                         eos_token_ids=side.eos_token_ids, model_name=side.name,
                         max_in_flight=config.parallel.pipeline_parallel_size,
                         async_scheduling=side.async_scheduling)
            engine.matmul_params = side.arch.matmul_params
            if config.step_trace:
                engine.step_trace = StepTraceWriter(config.step_trace)
            if side.runner is not None:  # the model in this process (tests and benchmarks read it)
                engine.runner = side.runner
            if side.tokenizer is not None:
                engine.grammar_queue = GrammarQueue(functools.partial(
                    _grammars, side.tokenizer, side.arch.vocab_size, side.eos_token_ids))
                if side.runner is not None:  # one cache for the compile thread and the sampler
                    side.runner.sampler.grammar_source = engine.grammar_queue.grammars
            predictor = config.scheduler.length_predictor
            if predictor == "auto":
                predictor = (str(auto_predictor_dir(side.name, side.arch.hidden_size, side.arch.num_layers))
                             if config.scheduler.policy == "srpt-predicted" else None)
            if predictor and predictor != "none":
                engine.lengths = OnlineLengthPredictor.load(
                    predictor, side.tokenizer,
                    store_text=config.scheduler.length_predictor_store_text,
                    hidden_size=side.arch.hidden_size, num_layers=side.arch.num_layers,
                    record=config.scheduler.length_predictor_record)
                policy = scheduler.policy
                if isinstance(policy, SpeculativeSRPTPolicy) and not engine.lengths.ready:
                    policy.start_warmup(make_policy("skip-join-mlfq", policy.ctx))
            return engine
        except BaseException:
            side.executor.close()
            raise

    def set_async_scheduling(self, on: bool) -> None:
        """Turn async scheduling on or off between steps (no plan in flight), e.g. to measure both
        on one loaded model; the executor must be able to overlap (LocalExecutor) or run plans
        submitted ahead (the worker executors)."""
        if self._pipe:
            raise RuntimeError("set_async_scheduling with plans in flight")
        if on and self.stages > 1:
            raise ValueError("async scheduling needs one pipeline stage")
        set_overlap = getattr(self.executor, "set_overlap", None)
        if set_overlap is not None:
            set_overlap(on)
        self._plan_ahead(on)

    def _plan_ahead(self, on: bool) -> None:
        """Async scheduling: step n+1 is planned and submitted before step n's tokens are back,
        its requests planned past their pending token (the executor fills it in), so the device
        never waits for the host's planning and output work (vLLM's async scheduling)."""
        self.scheduler.plan_ahead = on
        self.max_in_flight = 2 if on else self.stages

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.plan_ahead

    def close(self) -> None:
        """Release executor resources (transfer threads) and the length predictor. Idempotent."""
        self.executor.close()
        if self.grammar_queue is not None:
            self.grammar_queue.close()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.lengths is not None:
            self.lengths.close()
            self.lengths = None

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
                            expected_output_tokens, predicted_output_tokens, eos_after,
                            prompt_text=prompt if isinstance(prompt, str) else None)
        return self.add(new)

    def add(self, new: EngineRequest) -> Request:
        """Validate and admit a request; raises InvalidRequestError for one the engine refuses."""
        params = new.params
        params.validate()
        params.check_vocab(self.vocab_size)
        check_priority(new.priority, self.scheduler.policy)
        ids = list(new.prompt_token_ids)
        check_prompt(ids, self.max_model_len, self.vocab_size, self.scheduler.kv)
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # Extra end-of-sequence ids (Llama 3 lists several) stop like stop tokens.
            params = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + self.eos_token_ids[1:])
        now = self.clock.now()
        req = Request(new.request_id, ids, params, now if new.arrival_time is None else new.arrival_time,
                      user=new.user, tenant=new.tenant, priority=new.priority,
                      expected_output_tokens=new.expected_output_tokens,
                      predicted_output_tokens=new.predicted_output_tokens,
                      eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None)
        req.max_total_tokens = self.max_model_len
        req.eos_after = new.eos_after
        req.cache_prefix = new.cache_prefix
        req.prefix_leader = new.prefix_leader
        if self.lengths is not None and self.tokenizer is not None:
            self.lengths.predict(req, new.prompt_text)
        if (params.structured is None or self.grammar_queue is None
                or self.grammar_queue.submit(req, now, new.delivery_rate)):
            self.scheduler.add(req, now, new.delivery_rate)
        if self._text is not None and self.detokenize:
            self._text.add(req.request_id, ids, params)
        return req

    def set_priority(self, request_id: str, priority: int) -> bool:
        """Change a live request's priority (lower runs first); it takes effect at the next step.
        Returns False if the request is not live; raises InvalidRequestError (param "priority")
        for a non-zero priority under a policy that does not use priorities."""
        check_priority(priority, self.scheduler.policy)
        return self.scheduler.set_priority(request_id, priority, self.clock.now())

    def abort_request(self, request_id: str) -> bool:
        self.forget_outputs(request_id)
        if self.grammar_queue is not None and self.grammar_queue.abort(request_id):
            return True
        return self.scheduler.abort(request_id, self.clock.now()) is not None

    def take_failed(self) -> dict[str, str]:
        """Requests that ended before they ran (their grammar failed to compile), and why."""
        failed, self._failed = self._failed, {}
        for rid in failed:
            self.forget_outputs(rid)
        return failed

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler; with nothing else to run, wait a
        little for one rather than spin."""
        assert self.grammar_queue is not None
        idle = not self.scheduler.has_unfinished() and not self._pipe
        admitted, failed = self.grammar_queue.ready(self.clock.now(), wait_s=0.01 if idle else 0.0)
        now = self.clock.now()
        for req, delivery_rate in admitted:
            self.scheduler.add(req, now, delivery_rate)
        self._failed.update(failed)

    def forget_outputs(self, request_id: str) -> None:
        """Drop the text and logprobs kept for a request's next output: nobody will read it (an
        abort, or a trace replay that reads the requests instead of the outputs)."""
        if self._text is not None:
            self._text.forget(request_id)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Live requests (compiling their grammar too), or plans still in flight (of requests
        aborted meanwhile)."""
        return (self.scheduler.has_unfinished() or bool(self._pipe)
                or bool(self.grammar_queue is not None and len(self.grammar_queue)))

    def state(self) -> dict[str, Any]:
        """The scheduler as plain data for a live view (sched/snapshot.py): ids and counts, no text."""
        state = snapshot(self.scheduler, self.clock.now())
        if self.lengths is not None:
            state["length_predictor"] = self.lengths.describe()
        return state

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; an output for every request that got a token or finished."""
        if self.grammar_queue is not None and len(self.grammar_queue):
            self._admit_compiled()
        produced, finished = self.advance()
        outputs = [self._output(req, req.output_token_ids[-1:]) for req in produced]
        reported = {req.request_id for req in produced}
        for req in finished:
            if req.request_id not in reported:  # finished without a new token (abort, stall)
                outputs.append(self._output(req, []))
        if self._text is None or not self.detokenize:
            return outputs
        delivered = [out for out in outputs if self._text.process(out) != "drop"]
        stopped = self.scheduler.take_finished()  # what a stop string just ended (`_stop`)
        for req in stopped:
            self._text.forget(req.request_id)
        if self.lengths is not None and stopped:
            self._observe_lengths(stopped)
        return delivered

    def _observe_lengths(self, finished: list[Request]) -> None:
        """The length predictor learns from finished requests; once its self head has seen enough
        answers, srpt-predicted ranks by its predictions instead of skip-join-mlfq's queues."""
        assert self.lengths is not None
        self.lengths.observe(finished)
        policy = self.scheduler.policy
        if isinstance(policy, SpeculativeSRPTPolicy) and policy.warmup is not None and self.lengths.ready:
            policy.end_warmup()

    def _stop(self, request_id: str) -> None:
        """A stop string ended the request: free its KV now (its output already says "stop")."""
        self.scheduler.finish(request_id, "stop", self.clock.now())

    def advance(self, horizon: float = float("inf"), max_steps: int | None = None
                ) -> tuple[list[Request], list[Request]]:
        """schedule -> execute -> update; returns (requests with a new token, requests finished).

        `horizon` (the next arrival) and `max_steps` bound how far the simulator may repeat a
        decode batch in bulk (sim/engine.py); `produced` then lists each request once."""
        if self.max_in_flight > 1:
            return self._advance_pipelined(horizon)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.clock.now())
        t1 = time.perf_counter()
        ran = self._fast_forward(plan, horizon, max_steps)
        if ran is not None:
            finished = self.scheduler.take_finished()
            self.timings.schedule_s += t1 - t0
            self.timings.update_s += time.perf_counter() - t1
            return ran, finished
        counts = self._trace_counts()
        if self.lengths is not None:
            self.lengths.mark(plan)  # the states the self length head reads this step
        try:
            result = self.executor.execute(plan)
        except BaseException:
            self.scheduler.plan_lost(plan)
            raise
        self._executed(result)
        return self._apply(plan, result, t0, t1, counts)

    def _fast_forward(self, plan: StepPlan, horizon: float, max_steps: int | None) -> list[Request] | None:
        """The simulator repeats a decode batch in bulk here; a real engine runs every step."""
        return None

    def _executed(self, result: StepResult) -> None:
        """A plan's result is back; real time has passed by itself (the simulator advances its clock)."""

    def _wait_for_batch(self, horizon: float) -> bool:
        """Pipelined: whether to wait for the oldest batch now (the simulator may first admit an
        arrival due before that batch returns)."""
        return True

    def _step_start(self, perf_start: float) -> float:
        """When a traced step began: wall-clock time (the simulator's steps start on its clock)."""
        assert self.step_trace is not None
        return self.step_trace.wall_start(perf_start)

    def _advance_pipelined(self, horizon: float) -> tuple[list[Request], list[Request]]:
        """Pipeline stages (FastServe §4.3): submit batches of pending jobs while the pipe has
        room (the scheduler leaves out jobs whose token is in it), then take back the oldest
        batch: its tokens, finishes, and the policy's charge (a job whose quantum ran out in
        flight is demoted now). Async scheduling is the same loop with room for two plans, the
        scheduler planning a job in flight again past its pending token: the host plans step
        n+1 and applies step n while the executor runs step n+1."""
        ex, sched = self.executor, self.scheduler
        t0 = time.perf_counter()
        while len(self._pipe) < self.max_in_flight:
            plan = sched.schedule(self.clock.now())
            if self._pipe and not plan.has_work:
                sched.keep_released(plan)
                break
            if self.lengths is not None:
                self.lengths.mark(plan)
            ex.submit(plan)
            self._pipe.append(plan)
            if not plan.has_work:
                break  # nothing could start: wait for what the executor is doing
        t1 = time.perf_counter()
        counts = self._trace_counts()
        if not self._wait_for_batch(horizon):
            self.timings.schedule_s += t1 - t0
            return [], []
        plan = self._pipe.popleft()
        try:
            result = ex.poll()
        except BaseException:
            self.scheduler.plan_lost(plan)
            raise
        self._executed(result)
        return self._apply(plan, result, t0, t1, counts)

    def _apply(self, plan: StepPlan, result: StepResult, t0: float, t1: float, counts: tuple[int, int, int]
               ) -> tuple[list[Request], list[Request]]:
        """A plan's result into the scheduler (tokens, finishes), the length predictor and the
        step trace; `t0`/`t1`: when its scheduling began and ended, `counts`: the step trace's
        request counts after it."""
        t2 = time.perf_counter()
        self.num_steps += 1
        now = self.clock.now()
        # A request aborted while its plan was in flight (pipeline stages) gets no output: drop
        # its late logprobs rather than keep them forever.
        live = {rid for rid in (*result.logprobs, *result.prompt_logprobs) if rid in self.scheduler.requests}
        if self.lengths is not None:  # refined from the model's own states (or a recording), before
            # the step's tokens are charged: a request is not demoted past a prediction it just got
            for rid, total in self.lengths.refine(result.hidden, plan, self.scheduler.requests).items():
                self.scheduler.refine_prediction(rid, total, now)
        produced = self.scheduler.update(plan, result, now)
        for pending, new in ((self._logprobs, result.logprobs), (self._prompt_logprobs, result.prompt_logprobs)):
            for rid, lp in new.items():
                if rid in live:
                    pending.setdefault(rid, TokenLogprobs()).extend(lp)
        finished = self.scheduler.take_finished()
        if self.lengths is not None and finished:
            self._observe_lengths(finished)
        t3 = time.perf_counter()
        self.timings.schedule_s += t1 - t0
        self.timings.execute_s += t2 - t1
        self.timings.update_s += t3 - t2
        if self.step_trace is not None:
            self.step_trace.write(step_record(self.num_steps, self._step_start(t0), plan, result, counts,
                                              (t1 - t0, t2 - t1, t3 - t2), len(finished)))
        return produced, finished

    def _trace_counts(self) -> tuple[int, int, int]:
        """(running, waiting, preempted) requests as scheduling left them, where the simulator sees
        them; only counted for a step trace."""
        if self.step_trace is None:
            return 0, 0, 0
        sched = self.scheduler
        return sched.num_running, sched.num_waiting, sched.num_preempted

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        rid = req.request_id
        out = RequestOutput(rid, new_ids, "", req.is_finished, req.finish_reason, req.num_prompt_tokens,
                            req.num_output_tokens, req.metrics, req.user, tenant=req.tenant)
        if self._prompt_logprobs:
            out.prompt_logprobs = self._prompt_logprobs.pop(rid, None)
        if req.params.logprobs is not None:
            out.logprobs = self._logprobs.pop(rid, None)
            if out.logprobs is not None:
                req.cumulative_logprob += sum(out.logprobs.logprobs)
            out.cumulative_logprob = req.cumulative_logprob
        return out

    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run prompts to completion (offline use); results in prompt order."""
        prompts, plist = prompts_with_params(prompts, params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        results = {r.request_id: CompletionOutput(r.request_id, p if isinstance(p, str) else None, r.prompt_token_ids,
                                                  "", [], None, r.metrics)
                   for r, p in zip(reqs, prompts, strict=True)}
        while any(not r.is_finished for r in reqs):
            outputs = self.step()
            failed = self.take_failed()
            if failed:  # a grammar that did not compile: its request never ran
                for r in reqs:
                    self.abort_request(r.request_id)
                rid, why = next(iter(failed.items()))
                raise InvalidRequestError(f"request {rid}: {why}", "structured")
            for out in outputs:
                res = results.get(out.request_id)
                if res is not None:
                    res.text += out.text_delta
                    res.logprobs = joined_logprobs(res.logprobs, out.logprobs)
                    res.prompt_logprobs = joined_logprobs(res.prompt_logprobs, out.prompt_logprobs)
                    res.cumulative_logprob = out.cumulative_logprob
        for r in reqs:
            res = results[r.request_id]
            res.token_ids, res.finish_reason = list(r.output_token_ids), r.finish_reason
        return list(results.values())
