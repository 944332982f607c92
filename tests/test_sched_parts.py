"""The scheduler's parts: the Policy base class is the whole contract between scheduler and
policy, one preemption strategy per memory mode, the policy registry, and SchedulerStats as the
one record of preemptions and swaps (engine totals equal to the sums over requests)."""
from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from tokenslice.cli import build_parser
from tokenslice.cli.args import policy_list
from tokenslice.config import PREEMPTION_MODES, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import Request, SamplingParams
from tokenslice.sched.policy import LiveSetPolicy, Policy
from tokenslice.sched.registry import POLICY_NAMES, PREEMPTION_STRATEGIES, make_policy
from tokenslice.sched.scheduler import Scheduler

COST = load_cost_model("opt-13b@a100-40gb")


class LongestPromptFirst(LiveSetPolicy):
    """A policy written against the base class alone: ranked() is all it adds."""

    name = "longest-prompt-first"

    def ranked(self, now: float) -> Iterable[Request]:
        return sorted(self._live.values(), key=lambda r: -r.num_prompt_tokens)


def _engine(policy: Policy, mode: str, blocks: int = 24) -> Engine:
    eng = simulated_engine(SchedulerConfig(policy="fcfs", preemption=mode, max_batch_size=4), COST,
                           kv_cache_blocks=blocks, block_size=16, host_kv_blocks=4 * blocks)
    sched = eng.scheduler
    # Same scheduler, a policy the registry does not know.
    eng.scheduler = Scheduler(sched.config, policy, sched.kv, sched.ctx, swap_block_bytes=sched.preemption.swap_block_bytes)
    return eng


def _load(eng: Engine, n: int = 30, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [eng.add_request([7] * rng.randint(8, 120), SamplingParams(max_tokens=rng.randint(8, 120), ignore_eos=True),
                            request_id=f"r{i}") for i in range(n)]


@pytest.mark.parametrize("mode", PREEMPTION_MODES)
def test_a_policy_with_only_the_base_hooks_runs_in_every_memory_mode(mode: str) -> None:
    eng = _engine(LongestPromptFirst(), mode)
    reqs = _load(eng)
    while eng.has_unfinished() or eng.scheduler.kv.num_in_flight:
        eng.step()
    assert all(r.finish_reason == "length" and r.num_output_tokens == r.params.max_tokens for r in reqs)
    kv = eng.scheduler.kv
    kv.check()
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks


def test_base_policy_defaults_turn_optional_behaviour_off() -> None:
    pol = LongestPromptFirst()
    reqs = [Request(f"r{i}", [1] * (i + 1), SamplingParams(), 0.0) for i in range(3)]
    for r in reqs:
        pol.on_arrival(r, 0.0)
    # Next-run estimates default to rank positions; no burst-queue jobs; no device job limit.
    assert pol.next_run_estimates(0.0) == {"r2": 0.0, "r1": 1.0, "r0": 2.0}
    assert pol.next_run_estimate(reqs[0], 0.0) == 2.0
    assert list(pol.top_queue_jobs(2)) == [] and pol.device_job_limit(1000, 0.0) is None
    assert Policy().stable_steps(reqs, [0.1, 0.1], [0.1, 0.2]) == 1  # no fast-forward unless a policy bounds it


def test_one_strategy_per_memory_mode() -> None:
    assert set(PREEMPTION_STRATEGIES) == set(PREEMPTION_MODES)
    assert {m for m, s in PREEMPTION_STRATEGIES.items() if s.uses_host_tier} == {"reactive-swap", "proactive-swap"}
    assert [m for m, s in PREEMPTION_STRATEGIES.items() if not s.new_work_evicts] == ["defer"]
    for mode in PREEMPTION_MODES:
        eng = simulated_engine(SchedulerConfig(preemption=mode), COST, kv_cache_blocks=8, host_kv_blocks=8)
        assert eng.scheduler.preemption.mode == mode
        # The host pool exists only where the mode uses it.
        assert eng.scheduler.kv.host.num_blocks == (8 if PREEMPTION_STRATEGIES[mode].uses_host_tier else 0)


def test_registry_builds_every_listed_policy_and_nothing_else() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy 'lottery'"):
        make_policy("lottery")


def test_cli_policy_flags_offer_only_existing_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["serve", "--policy", "skip-join-mlfq"]).policy == "skip-join-mlfq"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "lottery"])
    assert "invalid choice: 'lottery'" in capsys.readouterr().err
    assert policy_list("fcfs, srpt-oracle") == ["fcfs", "srpt-oracle"]
    with pytest.raises(ValueError, match="unknown policy nope; choose from fcfs,"):
        policy_list("fcfs,nope")


@pytest.mark.parametrize("mode", ["recompute", "reactive-swap", "proactive-swap"])
def test_engine_totals_are_the_sums_over_requests(mode: str) -> None:
    eng = simulated_engine(SchedulerConfig(policy="skip-join-mlfq", preemption=mode, max_batch_size=6,
                                           starvation_limit_s=0.5), COST, kv_cache_blocks=30, block_size=16,
                           host_kv_blocks=40, enable_prefix_caching=False)  # swaps copied whole
    reqs = _load(eng, n=40, seed=1)
    while eng.has_unfinished() or eng.scheduler.kv.num_in_flight:
        eng.step()
    s = eng.scheduler.stats
    assert s.preemptions > 0  # the pool binds: the totals are not trivially zero
    assert s.preemptions == sum(r.metrics.preemptions for r in reqs)
    assert s.recomputed_tokens == sum(r.metrics.recomputed_tokens for r in reqs)
    assert s.swap_out_bytes == sum(r.metrics.swap_out_bytes for r in reqs)
    assert s.swap_in_bytes == sum(r.metrics.swap_in_bytes for r in reqs)
    assert s.swap_ops == sum(r.metrics.swap_ops for r in reqs)
    if mode == "recompute":
        assert s.swap_ops == 0 and s.recomputed_tokens > 0
    else:
        assert s.swap_out_bytes > 0 and s.swap_out_bytes == s.swap_in_bytes  # all came back
