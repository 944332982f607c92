"""Fairness policies on the simulator: `priority` (external, updatable at run time) and `vtc`
(Virtual Token Counter, Sheng et al. OSDI'24)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler import fingerprint
from tokenslice.bench.workloads import WorkloadRequest
from tokenslice.config import SchedulerConfig, parse_vtc_weights
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import InvalidRequestError, Request, RequestState, SamplingParams
from tokenslice.sched.registry import make_policy

COST = load_cost_model("opt-13b@a100-40gb")


def engine(policy: str, batch: int = 1, blocks: int = 100_000, **cfg) -> Engine:
    eng = simulated_engine(SchedulerConfig(policy=policy, max_batch_size=batch, **cfg), COST, kv_cache_blocks=blocks)
    eng.fast_forward = False
    return eng


def add(eng: Engine, rid: str, prompt: int = 8, out: int = 50, **kw) -> Request:
    return eng.add_request([0] * prompt, SamplingParams(max_tokens=out, ignore_eos=True), request_id=rid, **kw)


def first_token_order(eng: Engine, reqs: list[Request]) -> list[str]:
    while eng.has_unfinished():
        eng.step()
    return [r.request_id for r in sorted(reqs, key=lambda r: r.metrics.token_times[0])]


# ---- priority ---------------------------------------------------------------------------------
def test_priority_lower_first_and_ties_by_arrival() -> None:
    eng = engine("priority")
    reqs = [add(eng, "late-low", priority=3), add(eng, "a", priority=1), add(eng, "urgent", priority=-2),
            add(eng, "b", priority=1)]
    assert first_token_order(eng, reqs) == ["urgent", "a", "b", "late-low"]


def test_priority_update_reranks_and_preempts_at_the_next_step() -> None:
    eng = engine("priority")
    a = add(eng, "a", priority=0, out=100)
    b = add(eng, "b", priority=5, out=10)
    for _ in range(3):
        eng.step()
    assert a.state is RequestState.RUNNING and b.state is RequestState.WAITING
    assert eng.set_priority("b", -1)
    produced = {o.request_id for o in eng.step()}
    assert produced == {"b"}  # the very next step
    assert a.state is RequestState.PREEMPTED and a.metrics.preemptions == 1
    while not b.is_finished:
        assert {o.request_id for o in eng.step()} <= {"b"}
    assert eng.set_priority("a", 7) and not eng.set_priority("b", 0)  # b is gone
    first_token_order(eng, [a])
    assert a.num_output_tokens == 100


def test_priority_update_keeps_arrival_order_among_equals() -> None:
    eng = engine("priority")
    reqs = [add(eng, "x", priority=2), add(eng, "y", priority=1), add(eng, "z", priority=1)]
    eng.set_priority("x", 1)  # x arrived first: among equals it goes first
    assert first_token_order(eng, reqs) == ["x", "y", "z"]


def test_non_zero_priority_is_refused_by_policies_without_priorities() -> None:
    eng = engine("fcfs")
    with pytest.raises(InvalidRequestError) as exc:
        add(eng, "p", priority=1)
    assert exc.value.param == "priority" and "--policy priority" in str(exc.value)
    add(eng, "q", priority=0)
    with pytest.raises(InvalidRequestError) as exc:
        eng.set_priority("q", 3)
    assert exc.value.param == "priority"
    assert eng.set_priority("q", 0) and not eng.set_priority("nope", 0)


def trace(n: int, seed: int, users: int = 3) -> list[WorkloadRequest]:
    """Bursty arrivals, each request labelled with a user and a priority."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(4.0) * (0.1 if rng.random() < 0.3 else 1.0)
        out.append(WorkloadRequest(f"r{i}", t, None, rng.randint(1, 600), rng.randint(1, 300),
                                   user=f"u{rng.randrange(users)}", priority=rng.randrange(4)))
    return out


def test_trace_priorities_replay_unlabelled_under_other_policies() -> None:
    reqs = replay(engine("fcfs", batch=8), trace(10, seed=1))
    assert all(r.priority == 0 and r.finish_reason == "stop" for r in reqs)


@pytest.mark.parametrize("policy", ["priority", "vtc"])
@pytest.mark.parametrize("blocks", [100_000, 160])
def test_fast_forward_is_exact(policy: str, blocks: int) -> None:
    items = trace(60, seed=2)
    runs = []
    for ff in (False, True):
        eng = engine(policy, batch=8, blocks=blocks, vtc_weights="u0=2,u1=0.5")
        eng.fast_forward = ff
        runs.append(fingerprint(replay(eng, items)))
        if policy == "vtc":
            assert not eng.scheduler.policy.counters  # idle at the end: counters restart
    assert runs[0] == runs[1]


# ---- vtc --------------------------------------------------------------------------------------
def test_vtc_weights_flag_parses_and_refuses_bad_entries() -> None:
    assert parse_vtc_weights("alice=2, bob=0.5") == {"alice": 2.0, "bob": 0.5}
    assert parse_vtc_weights(None) == {}
    for bad in ("alice", "alice=0", "=2", "alice=x", "alice=1,alice=2", "a=inf"):
        with pytest.raises(ValueError, match="vtc_weights"):
            SchedulerConfig(policy="vtc", vtc_weights=bad).validate()
    with pytest.raises(ValueError, match="vtc_output_weight"):
        SchedulerConfig(vtc_output_weight=-1.0).validate()
    with pytest.raises(ValueError, match="both be 0"):
        SchedulerConfig(vtc_input_weight=0.0, vtc_output_weight=0.0).validate()


def test_vtc_counts_weighted_tokens_per_user() -> None:
    eng = engine("vtc", batch=4, vtc_input_weight=1.0, vtc_output_weight=2.0, vtc_weights="alice=2")
    pol = eng.scheduler.policy
    add(eng, "a", prompt=10, out=100, user="alice")
    add(eng, "b", prompt=6, out=100, user=None)
    for _ in range(5):  # prefill (samples one token) + 4 decodes, both in every batch
        eng.step()
    assert pol.counters == {"alice": (10 * 1 + 5 * 2) / 2, None: 6 * 1 + 5 * 2}


def test_vtc_new_user_is_lifted_to_the_least_active_counter() -> None:
    eng = engine("vtc", batch=2)
    pol = eng.scheduler.policy
    add(eng, "a1", out=400, user="a")
    add(eng, "b1", out=400, user="b")
    for _ in range(30):
        eng.step()
    least = min(pol.counters.values())
    assert least > 0
    add(eng, "c1", out=400, user="c")
    assert pol.counters["c"] == least  # no credit banked while it was away
    eng.step()
    # c now shares the batch rather than owning it until it catches up.
    assert sum(r.state is RequestState.RUNNING for r in eng.scheduler.requests.values()) == 2


def test_vtc_least_served_user_runs_first_and_heavy_user_waits() -> None:
    eng = engine("vtc", batch=1)
    heavy = [add(eng, f"h{i}", prompt=200, out=20, user="heavy") for i in range(3)]
    light = add(eng, "l0", prompt=5, out=20, user="light")
    eng.step()  # heavy arrived first: its prefill (200 input tokens) runs first
    assert heavy[0].num_output_tokens == 1
    for _ in range(20):
        eng.step()
    # light (5 + 2/token) stays below heavy's 202 for its whole request, so it was never paused.
    assert light.is_finished and light.metrics.preemptions == 0
    assert heavy[0].num_output_tokens == 1


def service(r: Request, w_in: float, w_out: float) -> float:
    """Weighted service a request received (no memory pressure: its KV is never dropped)."""
    return w_in * min(r.num_computed_tokens, r.num_prompt_tokens) + w_out * r.num_output_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.sampled_from([1, 2]),
       w_in=st.sampled_from([0.0, 1.0, 0.5]), w_out=st.sampled_from([1.0, 2.0, 3.0]),
       shares=st.tuples(st.sampled_from([1.0, 2.0, 0.5, 3.0]), st.sampled_from([1.0, 2.0, 0.5, 3.0])),
       jobs=st.tuples(*[st.lists(st.tuples(st.integers(1, 64), st.integers(1, 24)), min_size=3, max_size=12)] * 2))
def test_vtc_fairness_bound_for_two_backlogged_users(batch, w_in, w_out, shares, jobs) -> None:
    """VTC Theorem 4.4's setting: two users backlogged throughout (each keeps at least a batch of
    live requests), ample memory, a step budget covering every chunk. Every batch is then the
    selection loop's, so at every step the users' normalized services differ by at most one
    step's service of one user (a batch of requests' tokens, < their whole cost); over any
    interval, by at most twice the largest request's cost."""
    eng = engine("vtc", batch=batch, vtc_input_weight=w_in, vtc_output_weight=w_out,
                 vtc_weights=f"A={shares[0]},B={shares[1]}", max_tokens_per_step=4096)
    reqs = {u: [add(eng, f"{u}{i}", prompt=p, out=o, user=u) for i, (p, o) in enumerate(js)]
            for u, js in zip("AB", jobs, strict=True)}
    share = dict(zip("AB", shares, strict=True))
    largest = max((w_in * r.num_prompt_tokens + w_out * r.params.max_tokens) / share[u]
                  for u, rs in reqs.items() for r in rs)
    # One step's service of one user: a batch's worth of requests, since a user whose counter
    # admission leaves lowest (w_in 0) may take every slot of a step.
    step_max = batch * max((w_in * r.num_prompt_tokens + w_out) / share[u] for u, rs in reqs.items() for r in rs)

    def backlogged() -> bool:
        return all(sum(not r.is_finished for r in rs) >= batch for rs in reqs.values())

    diffs = [0.0]
    while backlogged():
        eng.step()
        s = {u: sum(service(r, w_in, w_out) for r in rs) / share[u] for u, rs in reqs.items()}
        diffs.append(s["A"] - s["B"])
        assert abs(diffs[-1]) <= step_max + 1e-9
        counters = eng.scheduler.policy.counters
        if backlogged():  # both active: the counters are the services (no lift since both arrived)
            assert (counters["A"], counters["B"]) == (pytest.approx(s["A"]), pytest.approx(s["B"]))
    assert max(diffs) - min(diffs) <= 2 * largest + 1e-9


def test_make_policy_builds_the_fair_policies() -> None:
    assert make_policy("priority").uses_priority and not make_policy("vtc").uses_priority
    assert not make_policy("fcfs").uses_priority
