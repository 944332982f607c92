"""Block groups on or off (FastSwitch §3.1): off, KV blocks come from a plain free list and a swap
moves one copy per block as vLLM; on, a request's KV sits in few contiguous runs. The toggle
changes how many copies a swap takes, never what is generated."""
from __future__ import annotations

import random

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.bench.simulate import SweepSpec, simulate_run
from tokenslice.bench.workloads import PriorityPattern, make_workload
from tokenslice.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenslice.predict.cost import load_cost_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
_RNG = random.Random(1)
LONG = [[1] + [_RNG.randrange(3, 500) for _ in range(50)] for _ in range(6)]
SHORT = [[1] + [_RNG.randrange(3, 500) for _ in range(3)] for _ in range(6)]


def _waves(block_groups: bool) -> tuple[list[list[int]], int, int]:
    # Long prompts start, short ones arrive and outrank them (fixed-priority): residents swap out.
    with LLM(str(STORIES), policy="fixed-priority", preemption="reactive-swap", kv_cache_blocks=14,
             max_batch_size=4, host_kv_blocks=64, eviction_amortization=0.0, enable_prefix_caching=False,
             block_groups=block_groups) as llm:
        eng = llm.engine
        reqs = [eng.add_request(p, GREEDY) for p in LONG]
        for _ in range(5):
            eng.step()
        reqs += [eng.add_request(p, GREEDY) for p in SHORT]
        while eng.has_unfinished():
            eng.step()
        stats = eng.scheduler.stats
        return [r.output_token_ids for r in reqs], stats.swap_ops, stats.swap_out_bytes


def test_real_engine_same_tokens_more_copies_without_block_groups() -> None:
    on_tokens, on_ops, on_bytes = _waves(True)
    off_tokens, off_ops, off_bytes = _waves(False)
    assert off_tokens == on_tokens
    assert on_bytes > 0 and off_bytes == on_bytes  # the same swaps, moved in more pieces
    assert off_ops > on_ops


def test_simulated_swaps_take_more_copies_without_block_groups() -> None:
    cost = load_cost_model("llama-8b@a10-24gb")
    wl = make_workload("synthetic-lognormal", num_requests=60, rate=4.0, cv=1.0, seed=0)
    pattern = PriorityPattern("random", 0.05, 4, 0)
    cfg = SchedulerConfig(policy="priority", preemption="reactive-swap", max_batch_size=16, eviction_amortization=0.0)

    def run(block_groups: bool):
        return simulate_run(cost, wl, cfg, 200, host_kv_blocks=4000, priority=pattern, block_groups=block_groups)
    (on, _), (off, _) = run(True), run(False)
    assert [r.output_tokens for r in off] == [r.output_tokens for r in on]
    assert sum(r.swap_out_bytes for r in off) == sum(r.swap_out_bytes for r in on) > 0
    assert sum(r.swap_ops for r in off) > sum(r.swap_ops for r in on)


def test_flag_option_and_sweep_field_default_on() -> None:
    from tokenslice.cli import build_parser, engine_config_from_args

    def cache(*flags: str) -> CacheConfig:
        return engine_config_from_args(build_parser().parse_args(["serve", *flags])).cache
    assert CacheConfig().block_groups and cache().block_groups and cache("--block-groups").block_groups
    assert not cache("--no-block-groups").block_groups
    assert not EngineConfig.from_options(block_groups=False).cache.block_groups
    assert SweepSpec("synthetic-fixed", ["fcfs"], rates=[1.0]).block_groups
    args = build_parser().parse_args(
        ["simulate", "--profile", "llama-8b@a10-24gb", "--workload", "synthetic-fixed", "--policy", "fcfs",
         "--rates", "1", "--no-block-groups"])
    assert args.block_groups is False
