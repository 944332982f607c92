"""Sync, async and adaptive swap-ins (FastSwitch §3.2; SchedulerConfig.swap_in): the adaptive
rule on known statistics; greedy outputs identical whichever way preempted KV and host prefix
hits are copied in, on the real engine under memory pressure in both swap modes; every block
free and KVManager.check() clean at the end and after aborts mid-way through a prefix load."""
from __future__ import annotations

import random

import pytest

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.config import SchedulerConfig
from tokenslice.sched.swap_in import SwapInChoice, prefer_async

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SWAP_MODES = ["reactive-swap", "proactive-swap"]


# ---- the decision --------------------------------------------------------------------------
def test_adaptive_rule_goes_async_for_a_large_copy_and_sync_for_a_tiny_one() -> None:
    # 1 ms a block, 20 ms a step, a tenth of a step: async above 2 blocks.
    choice = SwapInChoice("adaptive", 0.1, mode_async=False, block_seconds=1e-3, step_seconds=0.02)
    assert choice.is_async(100)
    assert not choice.is_async(1)
    assert prefer_async(0.5, 1.0, 0.1) and not prefer_async(0.05, 1.0, 0.1)


def test_adaptive_learns_from_measurements_and_falls_back_before_them() -> None:
    choice = SwapInChoice("adaptive", 0.1, mode_async=True)
    assert choice.is_async(1)  # nothing measured, no cost model: the mode's own choice
    choice.observe_step(0.02)
    assert not choice.is_async(1, model_copy_seconds=1e-4)  # copy from the cost model
    assert choice.is_async(1, model_copy_seconds=1e-2)
    choice.observe_copy(4, 4e-4)  # 0.1 ms a block measured: wins over the cost model
    assert choice.block_seconds == pytest.approx(1e-4)
    assert not choice.is_async(10, model_copy_seconds=1.0)
    assert choice.is_async(100)
    choice.observe_copy(1, 1.1e-3)  # a moving average: one slow copy moves it by a fifth
    assert choice.block_seconds == pytest.approx(3e-4)
    choice.observe_copy(0, 1.0)  # nothing copied, nothing learned
    assert choice.block_seconds == pytest.approx(3e-4)


def test_forced_and_mode_settings_ignore_statistics() -> None:
    stats = dict(block_seconds=1.0, step_seconds=1e-3)
    assert not SwapInChoice("sync", 0.1, True, **stats).is_async(100)
    assert SwapInChoice("async", 0.1, False, **stats).is_async(1)
    assert not SwapInChoice("mode", 0.1, False, **stats).is_async(100)
    assert SwapInChoice("mode", 0.1, True, **stats).is_async(1)


def test_setting_is_validated() -> None:
    assert SchedulerConfig().swap_in == "mode"
    with pytest.raises(ValueError):
        SchedulerConfig(swap_in="sometimes").validate()
    with pytest.raises(ValueError):
        SchedulerConfig(swap_in_async_fraction=-1.0).validate()


# ---- the engine ----------------------------------------------------------------------------
_RNG = random.Random(3)
LONG = [[1] + [_RNG.randrange(3, 500) for _ in range(50)] for _ in range(6)]
SHORT = [[1] + [_RNG.randrange(3, 500) for _ in range(3)] for _ in range(6)]
PREFIXED = [1] + [_RNG.randrange(3, 500) for _ in range(63)]
FILLERS = [[1] + [_RNG.randrange(3, 500) for _ in range(70)] for _ in range(3)]
FOLLOW = PREFIXED + [9, 8, 7]


def _watch_swap_ins(llm: LLM) -> dict[str, int]:
    """Count the plans' swap-ins by kind: sync (blocks in plan.swap_in) and async uploads."""
    sched = llm.engine.scheduler
    schedule = sched.schedule
    seen = {"sync": 0, "async": 0}

    def counting(now: float):
        plan = schedule(now)
        seen["sync"] += len(plan.swap_in)
        seen["async"] += sum(1 for t in plan.async_transfers if t.direction == "in")
        return plan

    sched.schedule = counting
    return seen


def _run(llm: LLM) -> list[list[int]]:
    """Long prompts start, short ones outrank them (fixed-priority): swaps. Then a request
    whose prefix was swapped out and evicted from the device finds it only on host."""
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in LONG[:3] + [PREFIXED]]
    for _ in range(4):
        eng.step()
    reqs += [eng.add_request(p, GREEDY) for p in SHORT]
    while eng.has_unfinished():
        eng.step()
    outs = [r.output_token_ids for r in reqs]
    for p in FILLERS:
        outs.append(llm.generate([p], GREEDY)[0].token_ids)
    outs.append(llm.generate([FOLLOW], GREEDY)[0].token_ids)
    return outs


def _options(preemption: str, swap_in: str, **extra) -> dict:
    # The stall guard off: it reads wall-clock time, and these tests count each choice's own copies.
    return dict(policy="fixed-priority", preemption=preemption, kv_cache_blocks=14, max_batch_size=4,
                host_kv_blocks=64, eviction_amortization=0.0, swap_in=swap_in, stall_guard="off", **extra)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    with LLM(str(STORIES), max_batch_size=1, enable_prefix_caching=False) as llm:
        return [llm.generate([p], GREEDY)[0].token_ids for p in LONG[:3] + [PREFIXED] + SHORT + FILLERS + [FOLLOW]]


@pytest.mark.parametrize("preemption", SWAP_MODES)
@pytest.mark.parametrize("swap_in", ["sync", "async", "adaptive"])
def test_greedy_outputs_identical_sync_async_adaptive(alone, preemption, swap_in):
    with LLM(str(STORIES), **_options(preemption, swap_in)) as llm:
        seen = _watch_swap_ins(llm)
        assert _run(llm) == alone
        sched = llm.engine.scheduler
        kv = sched.kv
        kv.check()
        assert kv.num_in_flight == 0 and kv.host.num_used == 0 and kv.device.num_free == 14
        assert sched.stats.swap_out_bytes > 0 and sched.stats.prefix_cache_host_hits > 0
        if swap_in == "sync":
            assert seen["sync"] > 0 and seen["async"] == 0
        elif swap_in == "async":
            assert seen["async"] > 0 and seen["sync"] == 0  # host prefix hits too
        else:
            assert seen["sync"] + seen["async"] > 0
            assert sched.preemption.swap_in.block_seconds is not None  # it measured copies


@pytest.mark.parametrize("preemption", SWAP_MODES)
def test_abort_mid_prefix_load_frees_everything(preemption):
    with LLM(str(STORIES), **_options(preemption, "async", max_tokens_per_step=512)) as llm:
        eng = llm.engine
        sched = eng.scheduler
        kv = sched.kv
        _run(llm)
        for p in FILLERS:  # evict FOLLOW's device copies: its prefix is then on host only
            llm.generate([p], GREEDY)
        schedule = sched.schedule
        aborted: list[str] = []

        def abort_loading(now: float):
            # After planning, before the executor copies: the window is open when the abort lands.
            plan = schedule(now)
            for t in plan.async_transfers:
                if t.direction == "in" and t.request_id in follow_ids and t.request_id in sched.requests:
                    eng.abort_request(t.request_id)
                    aborted.append(t.request_id)
                    assert kv.in_flight(t.request_id)
                    kv.check()
            return plan

        sched.schedule = abort_loading
        host_hits = sched.stats.prefix_cache_host_hits
        follow_ids = {eng.add_request(FOLLOW, GREEDY).request_id for _ in range(2)}
        while eng.has_unfinished() or kv.num_in_flight:
            eng.step()
            kv.check()
        assert aborted and sched.stats.prefix_cache_host_hits > host_hits
        assert kv.num_in_flight == 0 and kv.host.num_used == 0 and kv.device.num_free == 14
        # The host copies survive the aborted loads: a later request still finds them.
        sched.schedule = schedule
        again = llm.generate([FOLLOW], GREEDY)[0].token_ids
        kv.check()
        assert len(again) == GREEDY.max_tokens


# ---- the simulator ---------------------------------------------------------------------------
def test_simulated_copies_feed_the_statistics() -> None:
    """The simulator reports its async copies' seconds; adaptive measures them and the steps."""
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.predict.cost import load_cost_model

    # Guard off: its protected streams evict more, and with the host full some victims are recomputed.
    cfg = SchedulerConfig(policy="skip-join-mlfq", preemption="proactive-swap", max_batch_size=4,
                          starvation_limit_s=0.2, swap_in="adaptive", stall_guard="off")
    eng = simulated_engine(cfg, load_cost_model("opt-13b@a100-40gb"), kv_cache_blocks=40, block_size=16,
                           host_kv_blocks=400)
    for i in range(24):
        eng.add_request([7 + i] * 100, SamplingParams(max_tokens=200, ignore_eos=True), request_id=f"r{i}")
    while eng.has_unfinished():
        eng.step()
    sched = eng.scheduler
    choice = sched.preemption.swap_in
    assert sched.stats.swap_in_bytes > 0 and sched.stats.recomputed_tokens == 0
    assert choice.block_seconds is not None and choice.block_seconds > 0
    assert choice.step_seconds is not None and choice.step_seconds > 0
    sched.kv.check()
