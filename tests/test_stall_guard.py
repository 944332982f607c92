"""The stall guard (docs/DESIGN.md, "Stall guard") over every policy and memory mode, on the
simulator's engine (the same Scheduler, a cost model's times): a protected stream never loses its
KV and always runs in the next step; with room for it, no started stream waits past its bound;
the guard changes when requests run, never what they generate."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenslice.bench.workloads import WorkloadRequest
from tokenslice.config import PREEMPTION_MODES, SchedulerConfig
from tokenslice.delivery import qoe, reader_times, stall_seconds
from tokenslice.engine.engine import Engine
from tokenslice.plan import StepPlan
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import RequestState, SamplingParams
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import POLICY_NAMES, make_policy
from tokenslice.sched.scheduler import Scheduler
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay

COST = load_cost_model("opt-13b@a100-40gb")
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
BATCH = 4


def arrivals(seed: int, n: int, burst: float, rate: float = 4.0, prompt: tuple[int, int] = (1, 300),
             output: tuple[int, int] = (2, 120)) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) * (0.05 if rng.random() < burst else 1.0)
        out.append(WorkloadRequest(f"r{i}", t, None, rng.randint(*prompt), rng.randint(*output), user=f"u{i % 3}"))
    return out


class Watched:
    """Checks the guard's promise at every plan of a simulated engine's scheduler."""

    def __init__(self, eng: Engine) -> None:
        self.sched = eng.scheduler
        self.inner = self.sched.schedule
        self.sched.schedule = self.schedule  # type: ignore[method-assign]
        self.protected_plans = 0

    def schedule(self, now: float) -> StepPlan:
        kv = self.sched.kv
        on_device = {rid for rid in self.sched.requests if kv.residency(rid) == "device"}
        plan = self.inner(now)
        guard = self.sched.stall_guard
        # Never more than the device holds: protected streams would evict and reload each other.
        assert sum(kv.blocks_for_tokens(r.num_tokens) for r in guard.protected) <= kv.device.num_blocks
        for req in guard.protected:
            rid = req.request_id
            # Never evicted: a protected stream's KV stays (or comes back) on device this step.
            assert rid not in plan.drop, rid
            if rid in on_device:
                assert kv.residency(rid) == "device", (rid, kv.residency(rid))
            if rid in on_device and not kv.in_flight(rid):
                # Holding its KV, it runs in this step. (One whose KV must be loaded again runs
                # once room is made, best effort: other protected streams may hold the pool.)
                assert req.state is RequestState.RUNNING, (rid, req.state)
        self.protected_plans += bool(guard.protected)
        return plan


def run(policy: str, preemption: str, items: list[WorkloadRequest], blocks: int, **cfg: object) -> tuple[Engine, list, Watched]:
    config = SchedulerConfig(policy=policy, preemption=preemption, max_batch_size=BATCH, **cfg)
    eng = simulated_engine(config, COST, kv_cache_blocks=blocks, host_kv_blocks=blocks * 4)
    watched = Watched(eng)
    reqs = replay(eng, items)
    return eng, reqs, watched


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "srpt-predicted"] + ["srpt-predicted"])
@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), burst=st.floats(0.0, 0.9))
def test_protected_streams_are_never_evicted_and_run_next(policy: str, preemption: str, seed: int, burst: float) -> None:
    """Memory-bound (about four requests' KV): the guard's streams keep their KV and run."""
    items = arrivals(seed, 14, burst)
    eng, reqs, watched = run(policy, preemption, items, blocks=60, max_stall_ms=300.0, stall_guard="on")
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert eng.scheduler.kv.device.num_free == 60


class GuardLoads:
    """Watches a simulated engine's plans for streams the guard swaps back in (protected, on
    host before the plan, on device after it) and counts those whose KV leaves the device again
    before they ran more than one token."""

    def __init__(self, eng: Engine) -> None:
        self.sched = eng.scheduler
        self.inner = self.sched.schedule
        self.sched.schedule = self.schedule  # type: ignore[method-assign]
        self.tokens_at_load: dict[str, int] = {}
        self.loads = 0
        self.undone_within_a_token = 0

    def schedule(self, now: float) -> StepPlan:
        kv, guard = self.sched.kv, self.sched.stall_guard
        on_host = {rid for rid in self.sched.requests if kv.residency(rid) == "host"}
        plan = self.inner(now)
        for rid, req in self.sched.requests.items():
            if rid in on_host and kv.residency(rid) == "device" and guard.is_protected(rid):
                self.tokens_at_load[rid] = req.num_output_tokens
                self.loads += 1
            elif rid in self.tokens_at_load and kv.residency(rid) == "host":
                self.undone_within_a_token += req.num_output_tokens - self.tokens_at_load.pop(rid) <= 1
        return plan


@pytest.mark.parametrize("policies_see_cost", [True, False], ids=["cost-model", "measured-copies"])
def test_guard_loads_are_not_undone_under_memory_pressure(policies_see_cost: bool) -> None:
    """Bursts of long streams, far more KV than the device holds, proactive-swap (it offloads
    idle KV on its own to keep a burst reserve): a stream the guard swaps back in keeps running
    until the load is amortized, rather than being offloaded after one token and loaded again for
    the next (streams evicting and reloading each other), so the guard adds little swap traffic.
    Without a cost model (a real engine without --profile) the load's time is the measured one."""
    items = arrivals(1, 40, 0.8, rate=3.0, prompt=(20, 400), output=(50, 500))
    swapped_in = {}
    for guard in ("off", "on"):
        config = SchedulerConfig(policy="skip-join-mlfq", preemption="proactive-swap", max_batch_size=BATCH,
                                 stall_guard=guard)
        eng = simulated_engine(config, COST, kv_cache_blocks=80, host_kv_blocks=320)
        if not policies_see_cost:  # the same pools, a scheduler that only measures
            sched = eng.scheduler
            ctx = PolicyContext(config)
            eng.scheduler = Scheduler(config, make_policy(config.policy, ctx), sched.kv, ctx,
                                      swap_block_bytes=sched.preemption.swap_block_bytes)
        loads = GuardLoads(eng)
        reqs = replay(eng, items)
        assert all(r.finish_reason in ("stop", "length") for r in reqs)
        swapped_in[guard] = eng.scheduler.stats.swap_in_bytes
    assert loads.loads > 0  # the guard (the last run's) did load streams
    assert loads.undone_within_a_token <= loads.loads // 20, (loads.undone_within_a_token, loads.loads)
    assert swapped_in["on"] <= 1.25 * swapped_in["off"], swapped_in


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), burst=st.floats(0.0, 0.9))
def test_no_started_stream_waits_past_its_bound(policy: str, seed: int, burst: float) -> None:
    """Room for every stream's KV, the batch binding: each gap between two tokens stays within
    the bound plus one step (the token lands at the end of the step the stream was protected
    for; a step longer than the recent ones can overshoot by its length)."""
    items = arrivals(seed, 10, burst)
    bound_s = 0.4
    eng, reqs, watched = run(policy, "recompute", items, blocks=100_000, max_stall_ms=bound_s * 1e3,
                             stall_guard="off")
    longest_step = max(COST.first_iteration_seconds(2048), COST.decode_seconds(BATCH, 2048))
    for r in reqs:
        times = r.metrics.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps, default=0.0) <= bound_s + longest_step + 1e-9, (r.request_id, max(gaps))


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "srpt-oracle", "vtc"])
def test_the_guard_cuts_long_gaps_without_changing_service(policy: str) -> None:
    items = arrivals(3, 16, 0.7)
    _, off, _ = run(policy, "recompute", items, blocks=100_000, stall_guard="off")
    _, on, watched = run(policy, "recompute", items, blocks=100_000, stall_guard="off", max_stall_ms=300.0)
    gap = lambda reqs: max(b - a for r in reqs for a, b in zip(r.metrics.token_times, r.metrics.token_times[1:]))  # noqa: E731
    assert watched.protected_plans > 0
    assert gap(on) < gap(off)
    assert [r.num_output_tokens for r in on] == [r.num_output_tokens for r in off]


@pytest.mark.parametrize("preemption", ["recompute", "proactive-swap"])
def test_fast_forward_is_exact_with_the_guard(preemption: str) -> None:
    items = arrivals(5, 30, 0.5)
    results = []
    for ff in (False, True):
        config = SchedulerConfig(policy="skip-join-mlfq", preemption=preemption, max_batch_size=BATCH,
                                 stall_guard="on", max_stall_ms=250.0, delivery_rate=20.0)
        eng = simulated_engine(config, COST, kv_cache_blocks=200, host_kv_blocks=800)
        eng.fast_forward = ff
        results.append([(r.metrics.token_times, r.metrics.preemptions, r.metrics.stall_s) for r in replay(eng, items)])
    assert results[0] == results[1]


def test_reader_stall_and_qoe() -> None:
    # A reader at 2 tokens/s: the second token is read at 0.5 s; the third arrives 1 s late.
    read, stall = reader_times([0.0, 0.1, 2.0], 2.0)
    assert read == [0.0, 0.5, 2.0] and stall == pytest.approx(1.0)
    assert stall_seconds([0.0, 0.5, 1.0], 2.0) == 0.0
    assert qoe(0.0, [0.5, 1.0, 1.5], 2.0, expected_ttft_s=1.0) == 1.0  # ahead of the expected timeline
    assert qoe(0.0, [0.5, 1.0, 9.0], 2.0, expected_ttft_s=1.0) < 1.0
    assert qoe(0.0, [], 2.0) is None


def test_outputs_are_identical_with_the_guard_on_and_off() -> None:
    """A real model (stories260k) under heavy preemption: the guard changes when, not what.
    vtc over six users, batch 2: the two least-served users run each step, so started streams
    are paused at every step whatever the steps' speed (a time quantum would depend on it)."""
    from tokenslice.llm import LLM
    from tokenslice.request import EngineRequest

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs, preempted = [], []
    for guard in ({"stall_guard": "off"}, {"stall_guard": "on", "max_stall_ms": 1.0, "delivery_rate": 1000.0}):
        engine = LLM(str(STORIES), policy="vtc", max_batch_size=2, compile=False, **guard).engine
        reqs = [engine.add(EngineRequest(f"r{i}", engine.tokenize(f"Once upon a time {i}"), params, user=f"u{i}"))
                for i in range(6)]
        while engine.has_unfinished():
            engine.step()
        outs.append([list(r.output_token_ids) for r in reqs])
        preempted.append(engine.scheduler.stats.started_preemptions)
    assert outs[0] == outs[1]
    # Both runs pause started streams: at batch 2 the guard protects one (half the batch), the
    # one due first, so it changes which stream waits and when, and the tokens stay the same.
    assert preempted[0] > 0 and preempted[1] > 0


def test_prometheus_reports_reader_stall_and_started_preemptions() -> None:
    from prometheus_client import generate_latest

    from tokenslice.engine.protocol import EngineStats
    from tokenslice.request import RequestMetrics, RequestOutput
    from tokenslice.sched.stats import SchedulerStats
    from tokenslice.server.metrics import ServerMetrics

    stats = SchedulerStats()
    m = RequestMetrics(arrival_time=0.0)
    stats.record_preemption(m, started=False)
    stats.record_preemption(m, started=True)
    for t in (1.0, 1.1, 3.0):  # a reader at 2 tokens/s waits 1.0 s for the third token
        m.add_token_time(t, 2.0)
    m.finish_time = 3.0
    sm = ServerMetrics("m", stats=lambda: EngineStats(scheduler=stats), queued=lambda: 0)
    sm.observe(RequestOutput("r", [7], "", True, "stop", 1, 3, m))
    text = generate_latest(sm.registry).decode()
    assert 'tokenslice:request_stall_seconds_sum{model_name="m"} 1.0' in text
    assert 'tokenslice:num_started_preemptions_total{model_name="m"} 1.0' in text
    assert m.started_preemptions == 1 and m.preemptions == 2
