"""Swapping through the scheduler (simulated executor, so thousands of random steps run fast):
random arrivals, steps and aborts in every preemption mode never schedule a request whose KV is
not fully on device, never double-own or leak a block, and end with both tiers free; the
anti-thrashing protection bounds evictions where it is off they explode."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenslice.config import PREEMPTION_MODES, SWAP_IN_MODES, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.plan import StepPlan
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import SamplingParams

COST = load_cost_model("opt-13b@a100-40gb")


def _checked_engine(mode: str, device: int, host: int, policy: str = "skip-join-mlfq",
                    amortization: float = 16.0, swap_in: str = "mode") -> Engine:
    cfg = SchedulerConfig(policy=policy, preemption=mode, max_batch_size=4, max_tokens_per_step=64,
                          starvation_limit_s=0.05, eviction_amortization=amortization, swap_in=swap_in)
    eng = simulated_engine(cfg, COST, kv_cache_blocks=device, block_size=4, host_kv_blocks=host)
    eng.fast_forward = False
    sched, kv = eng.scheduler, eng.scheduler.kv
    schedule = sched.schedule

    def checked_schedule(now: float) -> StepPlan:
        plan = schedule(now)
        kv.check()
        moving = {t.request_id for t in plan.async_transfers}
        for s in plan.slices:  # every scheduled request is ready, on device, with room for its tokens
            rid = s.request_id
            assert kv.is_ready(rid) and kv.residency(rid) == "device" and rid not in moving
            assert len(kv.block_table(rid)) * kv.block_size >= s.start_pos + len(s.token_ids)
        return plan

    sched.schedule = checked_schedule  # type: ignore[method-assign]
    return eng


ops = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "step", "step", "step", "abort"]),
                         st.integers(1, 40), st.integers(1, 30)), min_size=5, max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(PREEMPTION_MODES), device=st.integers(12, 30), host=st.integers(0, 60), ops=ops,
       policy=st.sampled_from(["skip-join-mlfq", "srpt-predicted"]), swap_in=st.sampled_from(SWAP_IN_MODES))
def test_random_lifecycles_keep_every_invariant(mode, device, host, ops, policy, swap_in):
    eng = _checked_engine(mode, device, host, policy, swap_in=swap_in)
    live: list[str] = []
    for i, (op, a, b) in enumerate(ops):
        if op == "arrive":
            prompt = [7] * a
            if eng.scheduler.kv.blocks_for_tokens(a + b) <= device:
                live.append(eng.add_request(prompt, SamplingParams(max_tokens=b, ignore_eos=True, temperature=0),
                                            request_id=f"r{i}").request_id)
        elif op == "step" and eng.has_unfinished():
            eng.step()
        elif op == "abort" and live:
            eng.abort_request(live.pop(a % len(live)))
    for _ in range(10_000):
        if not eng.has_unfinished() and not eng.scheduler.kv.num_in_flight:
            break
        eng.step()
    kv = eng.scheduler.kv
    kv.check()
    assert not eng.has_unfinished() and kv.num_in_flight == 0
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks


def _promotion_storm(mode: str, amortization: float) -> int:
    """Many long jobs, a pool for a few, and a starvation limit of a few iterations: promoted
    jobs keep wanting each other's memory. Returns evictions (swaps out + drops)."""
    cfg = SchedulerConfig(policy="skip-join-mlfq", preemption=mode, max_batch_size=4,
                          starvation_limit_s=0.2, eviction_amortization=amortization)
    eng = simulated_engine(cfg, COST, kv_cache_blocks=40, block_size=16, host_kv_blocks=400)
    for i in range(24):
        eng.add_request([7 + i] * 100, SamplingParams(max_tokens=200, ignore_eos=True), request_id=f"r{i}")
    while eng.has_unfinished():
        eng.step()
    s = eng.scheduler.stats
    return s.preemptions


def test_protection_prevents_the_promotion_storm():
    for mode in ("recompute", "reactive-swap"):
        off, on = _promotion_storm(mode, 0.0), _promotion_storm(mode, 16.0)
        assert on * 3 < off, (mode, on, off)


def test_proactive_swap_overlaps_transfers_with_compute():
    # The mechanism alone: with the stall guard's streams at the head of every batch this tiny
    # pool swaps more, fills the small host tier and falls back to recompute twice.
    cfg = SchedulerConfig(policy="skip-join-mlfq", preemption="proactive-swap", max_batch_size=4,
                          starvation_limit_s=0.2, stall_guard="off")
    eng = simulated_engine(cfg, COST, kv_cache_blocks=40, block_size=16, host_kv_blocks=400)
    for i in range(24):
        eng.add_request([7 + i] * 100, SamplingParams(max_tokens=200, ignore_eos=True), request_id=f"r{i}")
    async_moves = 0
    schedule = eng.scheduler.schedule

    def counting(now: float) -> StepPlan:
        nonlocal async_moves
        plan = schedule(now)
        async_moves += len(plan.async_transfers)
        return plan

    eng.scheduler.schedule = counting  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    s = eng.scheduler.stats
    assert async_moves > 0 and s.swap_in_bytes > 0 and s.recomputed_tokens == 0
    assert dataclasses.asdict(cfg)["burst_reserve_jobs"] == 2


def test_a_request_that_outgrows_the_whole_pool_stops_with_length():
    # Two blocks of 16 tokens: the request fills them and cannot grow, and nobody can be evicted.
    for mode in PREEMPTION_MODES:
        eng = simulated_engine(SchedulerConfig(policy="skip-join-mlfq", preemption=mode), COST,
                               kv_cache_blocks=2, block_size=16, host_kv_blocks=8)
        req = eng.add_request([7] * 20, SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(100):
            if not eng.has_unfinished():
                break
            eng.step()
        assert req.finish_reason == "length" and len(req.output_token_ids) == 32 - 20 + 1  # the last one needs no KV
        assert eng.scheduler.kv.device.num_free == 2


def test_proactive_uploads_only_the_jobs_the_device_can_keep():
    # ALISE Algorithm 2: with room for 3 x 100 tokens (block 4, reserve 0), srpt-predicted keeps
    # the top 3 by predicted peak KV (prompt 20 + predicted 78-80); host jobs ranked past them stay.
    eng = simulated_engine(SchedulerConfig(policy="srpt-predicted", preemption="proactive-swap", srpt_aging=0.0),
                           COST, kv_cache_blocks=75, block_size=4, host_kv_blocks=200)
    reqs = [eng.add_request([7] * 20, SamplingParams(max_tokens=500, ignore_eos=True), request_id=f"r{i}",
                            predicted_output_tokens=78 + i) for i in range(6)]
    sched = eng.scheduler
    assert sched.policy.device_job_limit(75 * 4, 0.0) == 3
    kept = sched.preemption._within_device_job_limit(list(reversed(reqs)), 0, 0.0)
    assert sorted(r.request_id for r in kept) == ["r0", "r1", "r2"]
    # Without a limit (skip-join-mlfq) every host job is a candidate, in ENST order.
    mlfq = simulated_engine(SchedulerConfig(policy="skip-join-mlfq", preemption="proactive-swap"), COST,
                            kv_cache_blocks=75, block_size=4, host_kv_blocks=200).scheduler
    assert mlfq.preemption._within_device_job_limit(reqs, 0, 0.0) == reqs
