"""Block groups on or off (FastSwitch §3.1): off, KV blocks come from a plain free list and a swap
moves one copy per block as vLLM; on, a request's KV sits in few contiguous runs. The toggle
changes how many copies a swap takes, never what is generated (on the real engine:
tests/test_kv_swap_engine.py)."""
from __future__ import annotations

from tokenslice.sim.simulate import SweepSpec, simulate_run
from tokenslice.bench.priority_patterns import PriorityPattern
from tokenslice.bench.workloads import make_workload
from tokenslice.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenslice.predict.cost import load_cost_model


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
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args

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
