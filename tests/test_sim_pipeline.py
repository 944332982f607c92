"""The simulator with pipeline stages (sim/pipeline.py): several batches in flight through
the same scheduler code path as the real engine (FastServe §4.3's in-flight rule), on the
virtual clock. Throughput is counted in tokens per virtual second: deterministic."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenslice.bench.workloads import WorkloadRequest
from tokenslice.config import SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.sim.pipeline import PipelinedSimulatedExecutor
from tokenslice.plan import StepPlan
from tokenslice.predict.cost import BatchShape, load_cost_model

OPT_175B = "opt-175b@a100-40gb:tp8:pp2"  # FastServe §5: two p4d.24xlarge nodes, TP 8 x PP 2
MODES = [("fcfs", "recompute"), ("skip-join-mlfq", "proactive-swap"), ("srpt-oracle", "reactive-swap"),
         ("mlfq", "defer"), ("vtc", "recompute"), ("srpt-predicted", "proactive-swap")]


def _trace(n: int, seed: int = 0, rate: float | None = None) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        if rate:
            t += rng.expovariate(rate)
        out.append(WorkloadRequest(f"r{i}", t, None, rng.randint(16, 300), rng.randint(4, 120), user=f"u{i % 3}",
                                   predicted_output_tokens=rng.randint(4, 120)))
    return out


def _engine(policy: str, preemption: str, max_in_flight: int | None = None, *, blocks: int = 400,
            batch: int = 8, spec: str = OPT_175B) -> Engine:
    cfg = SchedulerConfig(policy=policy, preemption=preemption, max_batch_size=batch, max_tokens_per_step=2048)
    return simulated_engine(cfg, load_cost_model(spec), kv_cache_blocks=blocks, block_size=16, host_kv_blocks=4 * blocks,
                            max_in_flight=max_in_flight)


class InFlightWatch:
    """Wraps the engine's executor: asserts that no request is in two plans in flight, and
    records the most plans ever in flight at once."""

    def __init__(self, engine: Engine) -> None:
        self.ex = engine.executor
        self.flight: list[set[str]] = []
        self.most = 0
        self.submitted = 0
        submit, poll = self.ex.submit, self.ex.poll

        def checked_submit(plan: StepPlan) -> None:
            ids = {s.request_id for s in plan.slices}
            assert len(ids) == len(plan.slices)
            for other in self.flight:
                assert not ids & other, f"{sorted(ids & other)} in two batches in flight"
            self.flight.append(ids)
            self.most = max(self.most, len(self.flight))
            self.submitted += 1
            submit(plan)

        def checked_poll():  # type: ignore[no-untyped-def]
            self.flight.pop(0)
            return poll()

        self.ex.submit = checked_submit  # type: ignore[method-assign]
        self.ex.poll = checked_poll  # type: ignore[method-assign]


@pytest.mark.parametrize(("policy", "preemption"), MODES)
def test_two_batches_in_flight_complete_every_request_never_twice_in_the_pipe(policy: str, preemption: str) -> None:
    """Memory binds (preemptions, drops, swaps), requests arrive over time: every request
    finishes with its full output, and no request is ever in two batches in flight."""
    eng = _engine(policy, preemption, blocks=60)
    assert isinstance(eng.executor, PipelinedSimulatedExecutor) and eng.max_in_flight == 2
    watch = InFlightWatch(eng)
    trace = _trace(80, rate=40.0)
    reqs = replay(eng, trace)
    assert all(r.is_finished and r.finish_reason == "stop" for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [t.output_len for t in trace]
    assert watch.most == 2 and not watch.flight
    eng.scheduler.kv.check()
    assert eng.scheduler.kv.device.num_free == eng.scheduler.kv.device.num_blocks


def _tokens_per_virtual_second(eng: Engine, trace: list[WorkloadRequest]) -> float:
    reqs = replay(eng, trace)
    assert all(r.is_finished for r in reqs)
    return sum(r.num_output_tokens for r in reqs) / eng.clock.now()


@pytest.mark.parametrize(("policy", "preemption"), MODES[:3])
def test_two_in_flight_beat_one_when_enough_requests_are_ready(policy: str, preemption: str) -> None:
    """Enough work for two full batches: the second stage computes one batch while the first
    computes the next, so the pipe returns far more tokens per second than one batch at a time."""
    trace = _trace(64)  # all at t=0, 8 per batch
    one = _tokens_per_virtual_second(_engine(policy, preemption, 1), trace)
    two = _tokens_per_virtual_second(_engine(policy, preemption, 2), trace)
    assert two > 1.5 * one


def test_bubbles_when_fewer_batches_are_ready_than_stages() -> None:
    """One request: one batch at a time whatever the pipe allows, each stage idle half the time."""
    trace = _trace(1)
    eng1, eng2 = _engine("fcfs", "recompute", 1), _engine("fcfs", "recompute", 2)
    assert _tokens_per_virtual_second(eng1, trace) == pytest.approx(_tokens_per_virtual_second(eng2, trace))
    ex = eng2.executor
    assert isinstance(ex, PipelinedSimulatedExecutor)
    assert all(busy < 0.55 * eng2.clock.now() for busy in ex.stage_busy_s)


def test_batches_enter_a_stage_when_it_is_free() -> None:
    """Two batches submitted together: the second enters stage 0 when the first leaves it, and
    each is ready when it leaves the last stage; step_seconds is a batch's own time in the pipe."""
    cost = load_cost_model(OPT_175B)
    eng = _engine("fcfs", "recompute", 2)
    ex = eng.executor
    assert isinstance(ex, PipelinedSimulatedExecutor)
    for i, n in enumerate((8, 8)):
        eng.add_request([1] * 100, request_id=f"a{i}", arrival_time=0.0)
    plan = eng.scheduler.schedule(0.0)
    ex.submit(plan)
    eng.add_request([1] * 100, request_id="b", arrival_time=0.0)
    second = eng.scheduler.schedule(0.0)
    assert [s.request_id for s in second.slices] == ["b"]  # a0 and a1 are in the pipe
    ex.submit(second)
    s0, s1 = cost.stage_seconds(BatchShape.from_lengths(prefill=[(100, 0), (100, 0)]))
    t0, t1 = cost.stage_seconds(BatchShape.from_lengths(prefill=[(100, 0)]))
    hop2, hop1 = cost.p2p_seconds(200), cost.p2p_seconds(100)
    first_done = s0 + hop2 + s1
    second_done = max(s0 + t0 + hop1, s0 + hop2 + s1) + t1
    assert ex.next_ready() == pytest.approx(first_done)
    r1, r2 = ex.poll(), ex.poll()
    assert r1.done_at == pytest.approx(first_done) and r2.done_at == pytest.approx(second_done)
    assert r1.step_seconds == pytest.approx(s0 + hop2 + s1) and r2.step_seconds == pytest.approx(t0 + hop1 + t1)
    assert set(r1.sampled) == {"a0", "a1"} and set(r2.sampled) == {"b"}


def test_a_request_arriving_while_the_pipe_has_room_starts_before_the_oldest_returns() -> None:
    """A long prefill fills one slot; a short request arriving meanwhile is submitted to the free
    slot at its arrival, and follows the long batch down the pipe instead of waiting for its return."""
    cost = load_cost_model(OPT_175B)
    eng = _engine("fcfs", "recompute", 2)
    long_done = cost.iteration_seconds(BatchShape.from_lengths(prefill=[(2000, 0)]))
    trace = [WorkloadRequest("long", 0.0, None, 2000, 1), WorkloadRequest("short", 0.01, None, 10, 1)]
    long, short = replay(eng, trace)
    assert short.metrics.first_scheduled_time == pytest.approx(0.01)
    assert long.metrics.finish_time == pytest.approx(long_done)
    alone = cost.iteration_seconds(BatchShape.from_lengths(prefill=[(10, 0)]))
    assert long_done < short.metrics.finish_time < long_done + alone


def test_one_stage_profiles_keep_the_plain_simulator() -> None:
    """Without :ppM the simulator is the single-batch executor with fast-forward, as before."""
    eng = _engine("fcfs", "recompute", spec="opt-66b@a100-40gb:tp4")
    assert not isinstance(eng.executor, PipelinedSimulatedExecutor) and eng.fast_forward
    assert eng.max_in_flight == 1


def test_measured_profile_splits_into_stages() -> None:
    """A profile measured through M stages (one batch at a time): equal stage shares of the pass
    less the sends between them; it round-trips through JSON and drives the pipelined simulator."""
    from tokenslice.predict.cost import CostModel, TransferSpec
    from tokenslice.predict.profile import ProfileCostModel

    coef = {"base": 1e-3, "prefill_tokens": 1e-5, "decode_seqs": 2e-5, "context_tokens": 1e-7, "prefill_context": 0.0}
    cost = ProfileCostModel(coef, TransferSpec(1e10, 1e-5), 1024, model="m", device="cpu", pipeline_parallel=2,
                            p2p=TransferSpec(1e9, 30e-6), activation_bytes_per_token=2048)
    assert cost.name == "m@cpu:pp2"
    shape = BatchShape.from_lengths(decode=[64] * 8)
    stages = cost.stage_seconds(shape)
    assert cost.p2p_seconds(8) == pytest.approx(30e-6 + 8 * 2048 / 1e9)
    assert stages[0] == stages[1] and sum(stages) + cost.p2p_seconds(8) == pytest.approx(cost.iteration_seconds(shape))
    again = CostModel.from_dict(cost.to_dict())
    assert again.name == cost.name and again.stage_seconds(shape) == stages
    eng = simulated_engine(SchedulerConfig(policy="fcfs", max_batch_size=4), again, kv_cache_blocks=200)
    assert isinstance(eng.executor, PipelinedSimulatedExecutor) and eng.max_in_flight == 2
    reqs = replay(eng, _trace(12))
    assert all(r.is_finished for r in reqs)


def test_fitted_stage_factors_and_loop_time_shape_the_pipe() -> None:
    """Stages fitted to a real pipeline (`stage_factors`: one stage slower than an equal share)
    round-trip through JSON and bound two-in-flight throughput by the slow stage; the engine
    loop's time is serial between a batch's return and the next submit."""
    from tokenslice.predict.cost import CostModel, TransferSpec
    from tokenslice.predict.profile import ProfileCostModel

    coef = {"base": 1e-3, "prefill_tokens": 1e-5, "decode_seqs": 2e-5, "context_tokens": 1e-7, "prefill_context": 0.0}

    def cost(factors: list[float] | None, loop: float = 0.0) -> ProfileCostModel:
        return ProfileCostModel(coef, TransferSpec(1e10, 1e-5), 1024, model="m", device="cpu", pipeline_parallel=2,
                                p2p=TransferSpec(1e9, 30e-6), activation_bytes_per_token=2048,
                                stage_factors=factors, loop={"base": loop})

    with pytest.raises(ValueError, match="stage_factors"):
        cost([1.0])
    shape = BatchShape.from_lengths(decode=[64] * 8)
    equal, skewed = cost(None), cost([0.4, 1.6])
    e0, e1 = equal.stage_seconds(shape)
    assert skewed.stage_seconds(shape) == pytest.approx([0.4 * e0, 1.6 * e1])
    assert skewed.iteration_seconds(shape) == pytest.approx(sum(skewed.stage_seconds(shape)) + skewed.p2p_seconds(8))
    again = CostModel.from_dict(skewed.to_dict())
    assert isinstance(again, ProfileCostModel) and again.stage_factors == [0.4, 1.6]

    def run(model: ProfileCostModel, requests: int, in_flight: int) -> Engine:
        eng = simulated_engine(SchedulerConfig(policy="fcfs", max_batch_size=4), model, kv_cache_blocks=400,
                               max_in_flight=in_flight)
        replay(eng, [WorkloadRequest(f"r{i}", 0.0, None, 32, 40) for i in range(requests)])
        return eng

    fast, slow = run(equal, 8, 2), run(skewed, 8, 2)
    assert slow.num_steps == fast.num_steps and slow.clock.now() > fast.clock.now()
    ex = slow.executor
    assert isinstance(ex, PipelinedSimulatedExecutor)
    assert ex.stage_busy_s[1] == pytest.approx(4 * ex.stage_busy_s[0])  # the slow stage is the bubble-free one
    plain, looped = run(equal, 1, 1), run(cost(None, 2e-3), 1, 1)
    assert looped.clock.now() - plain.clock.now() == pytest.approx(looped.num_steps * 2e-3)


def test_a_measured_spread_of_stage_times_stalls_a_full_pipe() -> None:
    """Stage times drawn around their means (`stage_cv`, seeded): the same run twice gives the
    same clock, and two batches over two equal stages lose throughput to the jitter."""
    from tokenslice.predict.cost import CostModel, TransferSpec
    from tokenslice.predict.profile import ProfileCostModel

    coef = {"base": 1e-3, "prefill_tokens": 1e-5, "decode_seqs": 2e-5, "context_tokens": 1e-7, "prefill_context": 0.0}

    def cost(cv: list[float] | None) -> ProfileCostModel:
        return ProfileCostModel(coef, TransferSpec(1e10, 1e-5), 1024, model="m", device="cpu", pipeline_parallel=2,
                                p2p=TransferSpec(1e9, 30e-6), activation_bytes_per_token=2048, stage_cv=cv)

    with pytest.raises(ValueError, match="stage_cv"):
        cost([0.1, -0.1])
    jittery = CostModel.from_dict(cost([0.3, 0.3]).to_dict())
    assert jittery.stage_spread() == [0.3, 0.3] and cost(None).stage_spread() == [0.0, 0.0]

    def span(model: CostModel) -> float:
        eng = simulated_engine(SchedulerConfig(policy="fcfs", max_batch_size=4), model, kv_cache_blocks=400)
        replay(eng, [WorkloadRequest(f"r{i}", 0.0, None, 32, 40) for i in range(8)])
        return eng.clock.now()

    assert span(jittery) == span(jittery) > span(cost(None))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(MODES), stages=st.integers(2, 4),
       in_flight=st.integers(1, 4), blocks=st.integers(30, 120))
def test_in_flight_rule_holds_for_any_depth(seed: int, mode: tuple[str, str], stages: int, in_flight: int,
                                            blocks: int) -> None:
    """Property: whatever the policy, memory mode, stage count, pipe depth and KV pool, every
    request completes and none is ever in two batches in flight."""
    eng = _engine(*mode, in_flight, blocks=blocks, batch=4, spec=f"opt-66b@a100-40gb:tp2:pp{stages}")
    watch = InFlightWatch(eng)
    trace = _trace(30, seed=seed, rate=60.0)
    reqs = replay(eng, trace)
    assert [r.num_output_tokens for r in reqs] == [t.output_len for t in trace]
    assert watch.most <= in_flight and not watch.flight
    eng.scheduler.kv.check()
