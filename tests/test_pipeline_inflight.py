"""The in-flight rule with several plans in the pipeline (FastServe §4.3), on the scheduler with
a test executor that holds up to M plans and answers each only when the engine polls it: no
request is in two plans in flight, nothing in flight is evicted, moved or dropped, every request
finishes with all its tokens, and the KV pools end free; with M = 1 the engine's steps are the
one-plan loop's."""
from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenslice.config import PREEMPTION_MODES, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import SamplingParams, TokenLogprobs
from tokenslice.sched.scheduler import Scheduler

COST = load_cost_model("opt-13b@a100-40gb")
POLICIES = ["fcfs", "request-level", "mlfq", "fixed-priority", "skip-join-mlfq", "srpt-oracle", "srpt-predicted",
            "priority", "vtc"]


class PipelinedExecutor:
    """Holds up to `depth` plans; a plan's result (token 7 per sampling slice, its async copies
    done) comes back only from `poll`, oldest first. Checks the in-flight rule at each submit."""

    def __init__(self, depth: int, scheduler: Scheduler) -> None:
        self.depth = depth
        self.scheduler = scheduler
        self.pipe: deque[StepPlan] = deque()
        self.most_in_flight = 0
        self.step_seconds = 0.01

    def submit(self, plan: StepPlan) -> None:
        assert len(self.pipe) < self.depth
        ids = [s.request_id for s in plan.slices]
        assert len(ids) == len(set(ids))
        live = self.scheduler.requests
        flying = {s.request_id: s.block_table for p in self.pipe for s in p.slices if s.request_id in live}
        assert not flying.keys() & set(ids), "a request in two plans in flight"
        assert not flying.keys() & set(plan.drop), "KV of a request in flight dropped"
        assert not flying.keys() & {t.request_id for t in plan.async_transfers}, "KV in flight moved"
        kv = self.scheduler.kv
        for rid, table in flying.items():  # still on device, where the plan in flight writes it
            assert kv.residency(rid) == "device" and kv.block_table(rid)[:len(table)] == table, rid
        self.pipe.append(plan)
        self.most_in_flight = max(self.most_in_flight, len(self.pipe))

    def poll(self) -> StepResult:
        plan = self.pipe.popleft()
        asks = [s.request_id for s in plan.slices if s.sample and s.params.logprobs is not None]
        return StepResult(sampled={s.request_id: 7 for s in plan.slices if s.sample}, step_seconds=self.step_seconds,
                          transfers_done=[t.request_id for t in plan.async_transfers],
                          logprobs={rid: TokenLogprobs([7], [-0.5]) for rid in asks})

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.poll()

    def close(self) -> None:
        pass


def small_engine(policy: str, mode: str, device: int, host: int) -> Engine:
    """A simulated engine with small batches and pools (4-token blocks), every step taken alone
    (no fast-forward); tests/test_async_scheduling.py uses it too."""
    cfg = SchedulerConfig(policy=policy, preemption=mode, max_batch_size=3, max_tokens_per_step=48,
                          starvation_limit_s=0.05)
    eng = simulated_engine(cfg, COST, kv_cache_blocks=device, block_size=4, host_kv_blocks=host)
    eng.fast_forward = False
    return eng


def _pipelined(policy: str, mode: str, depth: int, device: int, host: int) -> tuple[Engine, PipelinedExecutor]:
    eng = small_engine(policy, mode, device, host)
    ex = PipelinedExecutor(depth, eng.scheduler)
    eng.executor, eng.max_in_flight = ex, depth
    return eng, ex


ops = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "step", "step", "step", "abort"]),
                         st.integers(1, 30), st.integers(1, 20)), min_size=5, max_size=60)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), mode=st.sampled_from(PREEMPTION_MODES), depth=st.integers(2, 4),
       device=st.integers(12, 30), host=st.integers(0, 60), ops=ops)
def test_in_flight_rule_holds_and_every_request_finishes(policy, mode, depth, device, host, ops):
    eng, ex = _pipelined(policy, mode, depth, device, host)
    live, kept = [], []
    for i, (op, a, b) in enumerate(ops):
        if op == "arrive" and eng.scheduler.kv.blocks_for_tokens(a + b) <= device:
            req = eng.add_request([7] * a, SamplingParams(max_tokens=b, ignore_eos=True, temperature=0),
                                  request_id=f"r{i}", predicted_output_tokens=b)
            live.append(req)
            kept.append((req, b))
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
    assert not eng.has_unfinished() and not ex.pipe and not sched._unsettled
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks
    for req, want in kept:
        if req.finish_reason != "abort":
            assert req.is_finished and req.finish_reason == "length" and len(req.output_token_ids) == want


def test_the_pipe_fills_with_disjoint_batches():
    # Six requests, batches of three, two stages: two batches in flight from the first step on.
    eng, ex = _pipelined("skip-join-mlfq", "recompute", 2, 100, 0)
    reqs = [eng.add_request([7] * 8, SamplingParams(max_tokens=5, ignore_eos=True), request_id=f"r{i}")
            for i in range(6)]
    eng.step()
    assert ex.most_in_flight == 2 and len(ex.pipe) == 1
    while eng.has_unfinished():
        eng.step()
    assert all(len(r.output_token_ids) == 5 for r in reqs)
    assert eng.scheduler.stats.preemptions == 0  # alternating batches are not preemptions


def test_a_quantum_that_ends_in_flight_demotes_when_the_token_returns():
    eng, ex = _pipelined("mlfq", "recompute", 2, 100, 0)
    ex.step_seconds = 10.0  # longer than the top queue's quantum
    policy = eng.scheduler.policy
    eng.add_request([7] * 4, SamplingParams(max_tokens=5, ignore_eos=True), request_id="long")
    level = lambda: next(i for i, q in enumerate(policy.queues) if "long" in q)  # noqa: E731
    plan = eng.scheduler.schedule(eng.clock.now())
    ex.submit(plan)
    eng._pipe.append(plan)
    assert level() == 0  # in flight: its quantum ended, but nothing is known of it yet
    eng.step()  # the only request is in flight: nothing to add, its result comes back
    assert level() == 1 and not ex.pipe


def test_a_request_aborted_in_flight_leaves_nothing_behind():
    eng, ex = _pipelined("fcfs", "recompute", 2, 100, 0)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
    gone = eng.add_request([7] * 4, params, request_id="gone")
    kept = eng.add_request([7] * 4, params, request_id="kept")
    plan = eng.scheduler.schedule(eng.clock.now())
    ex.submit(plan)
    eng._pipe.append(plan)
    assert eng.abort_request("gone") and gone.finish_reason == "abort"
    outs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    # Its token came back after the abort: only the abort's final output, no token, no logprobs.
    assert [(o.new_token_ids, o.logprobs, o.finish_reason) for o in outs["gone"]] == [([], None, "abort")]
    assert not eng._logprobs and not ex.pipe
    assert [len(o.logprobs) for o in outs["kept"]] == [1] * 5 and kept.num_output_tokens == 5
    kv = eng.scheduler.kv
    assert kv.device.num_free == kv.device.num_blocks
