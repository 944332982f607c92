"""Async scheduling (--async-scheduling): the engine plans step n+1 while step n runs, each
request of step n planned past its pending token, which the executor fills in. Outputs are the
synchronous loop's: on the scheduler with an executor that checks every pending token and the
in-flight rule, for every policy and memory mode with arrivals, aborts and early stops; and on a
real model, greedy, with preemption, swaps, penalties and stop strings."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import STORIES
from test_pipeline_inflight import POLICIES, small_engine
from tokenslice import LLM, SamplingParams
from tokenslice.config import PREEMPTION_MODES, EngineConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.exec.base import WorkerError
from tokenslice.plan import PENDING_TOKEN, StepPlan, StepResult
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import Request
from tokenslice.request import SamplingParams as Params
from tokenslice.sched.scheduler import Scheduler
from tokenslice.sim.engine import simulated_engine

STOP = 11  # a stop token the token function below samples now and then


def token_after(rid: str, position: int) -> int:
    """The token a request samples after computing `position`: a function of the position only,
    so that any schedule produces the same outputs."""
    return 10 + (position * 7 + int(rid[1:])) % 40


class AheadExecutor:
    """Runs a plan when it is submitted and answers it at `poll`, like a device that is one step
    behind the host. Fills pending tokens from the last plan's samples (as ModelRunner does) and
    checks that every token it computes is the one the request really has at that position, and
    that nothing in the plan still in flight is evicted, moved or dropped."""

    def __init__(self, scheduler: Scheduler, prompts: dict[str, int]) -> None:
        self.scheduler = scheduler
        self.prompts = prompts  # request id -> prompt length
        self.results: list[tuple[StepPlan, StepResult]] = []
        self.last_sampled: dict[str, int] = {}
        self.pending_filled = 0
        self.most_in_flight = 0

    def submit(self, plan: StepPlan) -> None:
        flying = {s.request_id: s for p, _ in self.results for s in p.slices}
        moved = set(plan.drop) | {t.request_id for t in plan.async_transfers}
        assert not flying.keys() & moved, "KV of a request in flight dropped or moved"
        sampled = {}
        for s in plan.slices:
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                if tok == PENDING_TOKEN:
                    prev = flying[s.request_id]  # planned ahead only of a step in flight ...
                    assert prev.sample and prev.start_pos + prev.num_tokens == pos  # ... that samples it
                    tok = s.token_ids[i] = self.last_sampled[s.request_id]
                    self.pending_filled += 1
                if pos >= self.prompts[s.request_id]:
                    assert tok == token_after(s.request_id, pos - 1), (s.request_id, pos)
            if s.sample:
                sampled[s.request_id] = token_after(s.request_id, s.start_pos + s.num_tokens - 1)
        self.last_sampled = sampled
        self.results.append((plan, StepResult(sampled=sampled, step_seconds=0.01,
                                              transfers_done=[t.request_id for t in plan.async_transfers])))
        self.most_in_flight = max(self.most_in_flight, len(self.results))

    def poll(self) -> StepResult:
        return self.results.pop(0)[1]

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.poll()

    def close(self) -> None:
        pass


def _engine(policy: str, mode: str, device: int, host: int, ahead: bool) -> tuple[Engine, AheadExecutor]:
    eng = small_engine(policy, mode, device, host)
    ex = AheadExecutor(eng.scheduler, {})
    eng.executor = ex
    eng.set_async_scheduling(ahead)
    return eng, ex


def _run(eng: Engine, ex: AheadExecutor, ops: list[tuple[str, int, int]], device: int) -> list[Request]:
    """Arrivals, steps and aborts, then steps until everything is done; checks nothing is left."""
    live, added = [], []
    for i, (op, a, b) in enumerate(ops):
        if op == "arrive" and eng.scheduler.kv.blocks_for_tokens(a + b) <= device:
            rid = f"r{i}"
            ex.prompts[rid] = a
            live.append(eng.add_request([7] * a, Params(max_tokens=b, temperature=0, stop_token_ids=[STOP]),
                                        request_id=rid, predicted_output_tokens=b))
            added.append(live[-1])
        elif op == "step" and eng.has_unfinished():
            eng.step()
        elif op == "abort" and live:
            eng.abort_request(live.pop(a % len(live)).request_id)
    for _ in range(10_000):
        if not eng.has_unfinished() and not eng.scheduler.kv.num_in_flight:
            break
        eng.step()
    sched, kv = eng.scheduler, eng.scheduler.kv
    kv.check()
    assert not eng.has_unfinished() and not ex.results and not sched._unsettled
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks
    return added


ops = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "step", "step", "step"]),
                         st.integers(1, 30), st.integers(1, 20)), min_size=5, max_size=50)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), mode=st.sampled_from(PREEMPTION_MODES), device=st.integers(12, 30),
       host=st.integers(0, 60), ops=ops)
def test_planned_ahead_outputs_are_the_synchronous_ones(policy, mode, device, host, ops):
    outputs = {}
    for ahead in (False, True):
        eng, ex = _engine(policy, mode, device, host, ahead)
        reqs = _run(eng, ex, ops, device)
        outputs[ahead] = [(r.request_id, r.output_token_ids, r.finish_reason) for r in reqs]
        for r in reqs:  # a stop token ends it; the token sampled for it in the step after is dropped
            assert r.output_token_ids.count(STOP) <= 1 and (STOP not in r.output_token_ids[:-1])
    assert outputs[True] == outputs[False]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), mode=st.sampled_from(PREEMPTION_MODES), device=st.integers(12, 30),
       host=st.integers(0, 60),
       ops=st.lists(st.tuples(st.sampled_from(["arrive", "step", "step", "abort"]), st.integers(1, 30),
                              st.integers(1, 20)), min_size=5, max_size=50))
def test_aborts_while_planned_ahead_leave_nothing_behind(policy, mode, device, host, ops):
    eng, ex = _engine(policy, mode, device, host, True)
    _run(eng, ex, ops, device)


def test_steps_overlap_and_pending_tokens_are_filled():
    eng, ex = _engine("fcfs", "recompute", 100, 0, True)
    ex.prompts.update(r0=5, r1=5)
    a = eng.add_request([7] * 5, Params(max_tokens=6, temperature=0, ignore_eos=True), request_id="r0")
    b = eng.add_request([7] * 5, Params(max_tokens=6, temperature=0, ignore_eos=True), request_id="r1")
    eng.step()
    assert ex.most_in_flight == 2 and len(ex.results) == 1  # step 2 submitted before step 1 was taken back
    while eng.has_unfinished():
        eng.step()
    assert ex.pending_filled == 2 * 5  # every token after the first was planned before it was sampled
    for r in (a, b):
        assert r.output_token_ids == [token_after(r.request_id, p) for p in range(4, 10)]
    # max_tokens is known ahead: the last token is not followed by a wasted step
    assert eng.num_steps == 6


def test_a_request_id_in_flight_cannot_come_back_yet():
    eng, ex = _engine("fcfs", "recompute", 100, 0, True)
    ex.prompts["r0"] = 3
    eng.add_request([7] * 3, Params(max_tokens=9, temperature=0, ignore_eos=True), request_id="r0")
    eng.step()  # r0 is in the plan still in flight
    eng.abort_request("r0")
    with pytest.raises(ValueError, match="still in a step in flight"):
        eng.add_request([7] * 3, Params(max_tokens=2), request_id="r0")
    while eng.has_unfinished():
        eng.step()
    ex.prompts["r0"] = 3
    eng.add_request([7] * 3, Params(max_tokens=2, temperature=0, ignore_eos=True), request_id="r0")


class FailingExecutor(AheadExecutor):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.fail_at = 3

    def poll(self) -> StepResult:
        self.fail_at -= 1
        if self.fail_at == 0:
            self.results.pop(0)
            raise RuntimeError("injected step failure")
        return super().poll()


def test_a_failed_step_leaves_no_request_in_flight():
    eng, _ = _engine("fcfs", "recompute", 100, 0, True)
    ex = FailingExecutor(eng.scheduler, {"r0": 4})
    eng.executor = ex
    eng.add_request([7] * 4, Params(max_tokens=9, temperature=0, ignore_eos=True), request_id="r0")
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(5):
            eng.step()
    eng.abort_request("r0")  # what the engine-core loop does after a failed step
    while eng.has_unfinished():
        eng.step()
    assert not eng.scheduler._unsettled
    assert eng.scheduler.kv.device.num_free == 100


def test_pipeline_stages_refuse_async_scheduling():
    cfg = EngineConfig.from_options(pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling needs pipeline_parallel_size 1"):
        cfg.validate()
    auto = EngineConfig.from_options()
    assert auto.async_scheduling_on("cuda") and not auto.async_scheduling_on("cpu")
    assert not EngineConfig.from_options(pipeline_parallel_size=2).async_scheduling_on("cuda")
    assert EngineConfig.from_options(async_scheduling=True).async_scheduling_on("cpu")
    staged = simulated_engine(SchedulerConfig(), load_cost_model("opt-13b@a100-40gb:pp2"), kv_cache_blocks=64)
    staged.set_async_scheduling(False)  # its stages keep their plans in flight
    assert staged.stages == staged.max_in_flight == 2
    with pytest.raises(ValueError, match="one pipeline stage"):
        staged.set_async_scheduling(True)


# ---- a real model --------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))] for _ in range(n)]


@pytest.fixture(scope="module")
def synchronous():
    prompts = _prompts(10)
    llm = LLM(str(STORIES), max_batch_size=1, async_scheduling=False)
    return prompts, [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq", "srpt-oracle", "vtc"])
@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_greedy_outputs_match_with_preemption_and_swaps(policy, preemption, synchronous):
    prompts, want = synchronous
    llm = LLM(str(STORIES), policy=policy, preemption=preemption, kv_cache_blocks=12, max_batch_size=4,
              starvation_limit_s=0.01, swap_space_gb=0.01, async_scheduling=True)
    assert llm.engine.async_scheduling and llm.engine.executor._thread is not None
    reqs = [llm.engine.add_request(p, GREEDY, expected_output_tokens=24) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [(r.output_token_ids, r.finish_reason) for r in reqs] == want
    sched = llm.engine.scheduler
    assert sched.kv.device.num_free == 12 and not sched._unsettled
    if preemption != "defer" and policy != "fcfs":
        assert sched.stats.preemptions > 0
    llm.engine.close()


def test_stop_strings_penalties_and_seeds_match():
    prompts = ["Once upon a time", "The little dog", "She said"]
    params = [SamplingParams(max_tokens=30, temperature=0, stop=["the", "."]),
              SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7)]
    got = {}
    for ahead in (False, True):
        llm = LLM(str(STORIES), async_scheduling=ahead)
        got[ahead] = [(o.text, o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        llm.engine.close()
    assert got[True] == got[False]
    assert got[True][0][2] == "stop"


def test_a_fault_in_the_step_thread_reaches_the_engine():
    llm = LLM(str(STORIES), async_scheduling=True)
    runner = llm.engine.runner

    def broken(plan):
        raise WorkerError("rank gone")

    llm.engine.add_request("Once upon a time", GREEDY)
    runner.execute = broken
    with pytest.raises(WorkerError, match="rank gone"):
        llm.engine.step()
    llm.engine.close()


def test_async_scheduling_turns_on_and_off_between_steps(synchronous):
    prompts, want = synchronous
    llm = LLM(str(STORIES), max_batch_size=4, async_scheduling=False)
    eng = llm.engine
    assert not eng.async_scheduling and eng.executor._thread is None
    eng.set_async_scheduling(True)
    assert eng.executor._thread is not None and eng.max_in_flight == 2
    assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, GREEDY)] == want
    eng.add_request(prompts[0], GREEDY)
    eng.step()  # a plan is in flight now
    with pytest.raises(RuntimeError, match="plans in flight"):
        eng.set_async_scheduling(False)
    while eng.has_unfinished():
        eng.step()
    eng.set_async_scheduling(False)
    assert eng.executor._thread is None and eng.max_in_flight == 1
    assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, GREEDY)] == want
    eng.close()


def test_a_served_stream_is_the_same_with_async_scheduling():
    # The engine-core process plans ahead; streamed text, stop strings and usage are unchanged.
    import openai

    from serverkit import start_server

    def answers(*flags: str) -> list[tuple[str, str | None, int]]:
        with start_server("--model", str(STORIES), "--kv-cache-blocks", "24", "--max-batch-size", "4",
                          *flags) as srv:
            client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=60)
            out = []
            for prompt, stop in (("Once upon a time", None), ("The little dog", ["the"]), ("She said", ["."])):
                chunks = list(client.completions.create(model=str(STORIES), prompt=prompt, max_tokens=24,
                                                        temperature=0, stop=stop, stream=True,
                                                        stream_options={"include_usage": True}))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
                out.append((text, reason, chunks[-1].usage.completion_tokens))
            return out

    sync = answers("--no-async-scheduling")
    assert answers("--async-scheduling") == sync
    assert {reason for _, reason, _ in sync} == {"length", "stop"}
