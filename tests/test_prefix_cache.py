"""Prefix caching (kv/prefix.py, KVManager, scheduler): cached blocks are kept until space is
needed and never handed out while referenced; a request reuses the longest cached prefix of
full blocks; greedy outputs are the same with caching on and off in every memory mode, with
and without preemption, and a second conversation turn really starts from the cache."""
from __future__ import annotations

import random

import pytest

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.config import PREEMPTION_MODES
from tokenslice.kv.blocks import BlockPool
from tokenslice.kv.manager import KVManager
from tokenslice.kv.prefix import PrefixCache

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _source(tokens: list[int]):
    return lambda start, end: tokens[start:end]


# ---- pool and cache ---------------------------------------------------------------------------
def test_freed_cached_blocks_stay_until_space_is_needed_lru_first() -> None:
    pool = BlockPool(4)
    cache = PrefixCache(pool)
    a = pool.allocate(2)
    assert cache.insert(11, a[0]) and cache.insert(12, a[1])
    assert not cache.insert(11, a[1])  # a hash keeps its first block
    assert pool.num_free == 2  # referenced by the request: not evictable
    pool.free(a)
    assert pool.num_free == 4 and pool.num_evictable == 2 and cache.match([11, 12]) == a
    b = pool.allocate(2)  # the never-used blocks go first
    assert set(b).isdisjoint(a) and len(cache) == 2
    pool.share(a[1])  # reused by a new request: no longer evictable
    assert pool.allocate(1) == [a[0]]  # the only evictable one
    assert cache.get(11) is None and cache.get(12) == a[1]
    with pytest.raises(Exception):
        pool.allocate(1)  # a[1] is referenced: never handed out


def test_attach_shares_full_blocks_and_leaves_a_token_to_compute() -> None:
    kv = KVManager(4, 16, prefix_caching=True)
    toks = list(range(100, 110))  # two full blocks and two tokens
    kv.ensure("a", 10)
    kv.cache_computed("a", 10, _source(toks))
    kv.check()
    hit = kv.attach_prefix("b", 10, _source(toks))
    assert (hit.device_blocks, hit.num_tokens) == (2, 8)
    assert kv.block_table("b") == kv.block_table("a")[:2]
    assert kv.device.ref_count(kv.block_table("a")[0]) == 3  # two tables and the cache
    kv.ensure("b", 10)
    assert kv.block_table("b")[2] != kv.block_table("a")[2]  # the partial block is private
    kv.check()
    kv.free("a")
    kv.check()
    # A prompt that is all cached recomputes its last block's worth: one token must remain.
    assert kv.attach_prefix("c", 8, _source(toks)).num_tokens == 4
    kv.free("b")
    kv.free("c")
    kv.check()
    assert kv.device.num_free == 16 and kv.device.num_evictable == 2
    assert kv.attach_prefix("d", 9, _source(toks)).num_tokens == 8
    kv.detach_prefix("d")
    assert kv.block_table("d") == [] and kv.device.num_evictable == 2
    kv.check()


def test_reclaimable_counts_only_blocks_no_one_else_holds() -> None:
    kv = KVManager(4, 16, prefix_caching=True)
    toks = list(range(12))
    kv.ensure("a", 12)
    kv.cache_computed("a", 12, _source(toks))
    kv.attach_prefix("b", 12, _source(toks))  # shares a's first two blocks
    kv.ensure("b", 12)
    assert kv.reclaimable(["a"]) == 1  # a's third block is cached but its first two are b's too
    assert kv.reclaimable(["a", "b"]) == 4


# ---- greedy outputs on the real engine --------------------------------------------------------
def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts sharing prefixes of 0..3 blocks of 16 tokens, and some identical ones."""
    rng = random.Random(seed)
    bases = [[1] + [rng.randrange(3, 500) for _ in range(47)] for _ in range(3)]
    out = []
    for i in range(n):
        base = bases[i % 3][:rng.choice([0, 16, 33, 48])]
        out.append(base + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] if i % 5 else bases[i % 3])
    return out


def _run(llm: LLM, prompts: list[list[int]], stagger: int = 0) -> list[list[int]]:
    eng = llm.engine
    reqs = []
    for p in prompts:
        reqs.append(eng.add_request(p, GREEDY))
        for _ in range(stagger):
            if eng.has_unfinished():
                eng.step()
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module", params=["stories260k", "tiny-llama"])
def reference(request, tiny_checkpoints):
    path = str(STORIES) if request.param == "stories260k" else str(tiny_checkpoints["llama"])
    prompts = _prompts(15)
    with LLM(path, max_batch_size=1, enable_prefix_caching=False) as alone:
        return path, prompts, [alone.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
@pytest.mark.parametrize("pressure", [False, True])
def test_greedy_outputs_identical_with_caching_on_and_off(reference, preemption, pressure):
    path, prompts, alone = reference
    memory = dict(kv_cache_blocks=14, starvation_limit_s=0.01, eviction_amortization=0.0) if pressure else {}
    for caching in (True, False):
        with LLM(path, policy="skip-join-mlfq", preemption=preemption, max_batch_size=4, host_kv_blocks=64,
                 enable_prefix_caching=caching, **memory) as llm:
            assert _run(llm, prompts, stagger=2) == alone, caching
            sched = llm.engine.scheduler
            kv = sched.kv
            kv.check()
            assert kv.num_in_flight == 0 and kv.host.num_free == kv.host.num_blocks
            assert kv.device.num_free == kv.device.num_blocks
            if caching:
                assert sched.stats.prefix_cache_device_hits > 0
            else:
                assert sched.stats.prefix_cache_queries == 0 and kv.device.num_evictable == 0
            if pressure and preemption != "defer":
                assert sched.stats.preemptions > 0


def _prefill_counter(llm: LLM) -> list[int]:
    """Counts the prompt tokens each plan computes (observes the real scheduler)."""
    sched = llm.engine.scheduler
    schedule = sched.schedule
    count = [0]

    def counted(now: float):
        plan = schedule(now)
        count[0] += sum(s.num_tokens for s in plan.prefill)
        return plan

    sched.schedule = counted  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_second_turn_starts_from_the_cache(reference, preemption):
    path, prompts, _ = reference
    turn1 = prompts[0]
    outs = {}
    for caching in (True, False):
        with LLM(path, preemption=preemption, host_kv_blocks=64, enable_prefix_caching=caching) as llm:
            answer = llm.generate([turn1], GREEDY)[0].token_ids
            turn2 = turn1 + answer + [7, 8, 9, 10, 11]
            prefill = _prefill_counter(llm)
            outs[caching] = llm.generate([turn2], GREEDY)[0].token_ids
            stats = llm.engine.scheduler.stats
            if caching:
                cached = (len(turn1) + len(answer) - 1) // 16 * 16  # its computed full blocks
                assert stats.prefix_cache_device_hits == cached > 0
                assert prefill[0] == len(turn2) - cached
            else:
                assert prefill[0] == len(turn2)
    assert outs[True] == outs[False]


def test_flag_and_option_default_on() -> None:
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args
    from tokenslice.config import EngineConfig

    def cache(*flags: str):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags])).cache
    assert cache().enable_prefix_caching and cache("--enable-prefix-caching").enable_prefix_caching
    assert not cache("--no-enable-prefix-caching").enable_prefix_caching
    assert not EngineConfig.from_options(enable_prefix_caching=False).cache.enable_prefix_caching


def test_metrics_export_queries_and_hits_by_tier(stories_llm) -> None:
    from prometheus_client import generate_latest

    from tokenslice.engine.protocol import read_stats
    from tokenslice.server.metrics import ServerMetrics

    llm = stories_llm
    turn1 = _prompts(1)[0]
    answer = llm.generate([turn1], GREEDY)[0].token_ids
    llm.generate([turn1 + answer + [5]], GREEDY)
    stats = llm.engine.scheduler.stats
    text = generate_latest(ServerMetrics("m", lambda: read_stats(llm.engine), lambda: 0).registry).decode()
    assert f'tokenslice:prefix_cache_queries_total{{model_name="m"}} {float(stats.prefix_cache_queries)}' in text
    hits = f'tokenslice:prefix_cache_hits_total{{model_name="m",tier="device"}} {float(stats.prefix_cache_device_hits)}'
    assert hits in text and stats.prefix_cache_device_hits > 0
    assert 'tokenslice:prefix_cache_hits_total{model_name="m",tier="host"} 0.0' in text


# ---- host tier --------------------------------------------------------------------------------
def test_swaps_copy_only_what_the_other_tier_lacks() -> None:
    kv = KVManager(4, 8, 8, prefix_caching=True)
    toks = list(range(200, 216))
    kv.ensure("a", 14)
    kv.cache_computed("a", 14, _source(toks))  # three full blocks computed
    assert len(kv.swap_out("a")) == 4
    kv.end_plan()
    assert kv.host.num_used == 4
    assert len(kv.swap_in("a")) == 1  # its computed blocks are still cached on device: shared again
    kv.end_plan()
    kv.check()
    assert kv.host.num_free == 8 and kv.host.num_evictable == 3  # the computed blocks' copies stay
    kv.ensure("a", 16)
    pairs = kv.swap_out("a")  # the three copies are still valid: only the last block moves
    assert len(pairs) == 1 and kv.host_blocks("a")[3] == pairs[0][1]
    kv.end_plan()
    kv.check()
    kv.free("a")
    # The device copies are evicted by other work; the prefix is found on host and copied in.
    kv.ensure("other", 32)
    kv.free("other")
    hit = kv.attach_prefix("b", 16, _source(toks))
    assert (hit.device_blocks, hit.host_blocks, hit.num_tokens) == (0, 3, 12)
    pairs = kv.load_host_prefix("b")
    assert len(pairs) == 3 and [d for _, d in pairs] == kv.block_table("b")
    kv.check()
    kv.end_plan()
    kv.ensure("b", 16)
    kv.check()
    # A host block reused for something else no longer counts as a copy (contamination).
    kv.free("b")
    kv.ensure("c", 32)
    kv.free("c")  # every device copy evicted
    kv.ensure("d", 4)
    kv.swap_out("d")
    kv.end_plan()
    kv.ensure("e", 4 * 7)
    kv.swap_out("e")  # takes the rest of the host tier: every cached host copy is evicted
    kv.end_plan()
    assert kv.attach_prefix("f", 16, _source(toks)).num_tokens == 0
    kv.check()


def _host_hit_run(path: str, preemption: str, caching: bool, **options) -> tuple[list[int], LLM]:
    """A long request is swapped out by short ones (fixed-priority: shortest prompt first) and
    finishes; unrelated requests then take the device pool, evicting its device copies; a
    follow-up request with the same prefix finds it only on host."""
    rng = random.Random(11)
    long = [1] + [rng.randrange(3, 500) for _ in range(63)]
    shorts = [[1] + [rng.randrange(3, 500) for _ in range(5)] for _ in range(4)]
    fillers = [[1] + [rng.randrange(3, 500) for _ in range(70)] for _ in range(3)]
    llm = LLM(path, policy="fixed-priority", preemption=preemption, kv_cache_blocks=10, max_batch_size=4,
              host_kv_blocks=64, eviction_amortization=0.0, enable_prefix_caching=caching, **options)
    eng = llm.engine
    eng.add_request(long, GREEDY)
    for _ in range(3):
        eng.step()
    for p in shorts:
        eng.add_request(p, GREEDY)
    while eng.has_unfinished():
        eng.step()
    for p in fillers:
        llm.generate([p], GREEDY)
    follow = llm.generate([long + [9, 8, 7]], GREEDY)[0].token_ids
    return follow, llm


@pytest.mark.parametrize("preemption", ["reactive-swap", "proactive-swap"])
def test_prefix_only_on_host_is_swapped_in_and_output_unchanged(reference, preemption):
    path = reference[0]
    want, off = _host_hit_run(path, preemption, caching=False)
    off.close()
    got, llm = _host_hit_run(path, preemption, caching=True)
    with llm:
        stats = llm.engine.scheduler.stats
        assert stats.swap_out_bytes > 0  # the long request really was swapped out
        assert stats.prefix_cache_host_hits >= 48 and got == want
        kv = llm.engine.scheduler.kv
        kv.check()
        assert kv.host.num_used == 0 and kv.host.num_evictable > 0


def test_host_hits_with_int8_offload(reference):
    """Host blocks are just host blocks: an int8 host copy is dequantized on its way in."""
    got, llm = _host_hit_run(reference[0], "reactive-swap", caching=True, offload_dtype="int8")
    with llm:
        assert llm.engine.scheduler.stats.prefix_cache_host_hits >= 48 and len(got) == GREEDY.max_tokens
        llm.engine.scheduler.kv.check()


@pytest.mark.parametrize("preemption", ["reactive-swap", "proactive-swap"])
def test_evicted_device_blocks_are_offloaded_and_found_on_host(reference, preemption):
    """No request is ever swapped out (one runs at a time): the first request's cached blocks
    reach host only by being offloaded when other requests evict them from the device."""
    path = reference[0]
    rng = random.Random(12)
    first = [1] + [rng.randrange(3, 500) for _ in range(63)]
    fillers = [[1] + [rng.randrange(3, 500) for _ in range(70)] for _ in range(3)]
    outs = {}
    for caching in (False, True):
        with LLM(path, preemption=preemption, kv_cache_blocks=10, max_batch_size=1, host_kv_blocks=64,
                 enable_prefix_caching=caching) as llm:
            for p in [first] + fillers:
                llm.generate([p], GREEDY)
            outs[caching] = llm.generate([first + [9, 8, 7]], GREEDY)[0].token_ids
            stats = llm.engine.scheduler.stats
            assert stats.swap_out_bytes == 0
            if caching:
                assert stats.prefix_cache_offload_bytes > 0 and stats.prefix_cache_host_hits >= 48
                assert stats.prefix_cache_device_hits == 0  # its device copies were all evicted
                llm.engine.scheduler.kv.check()
    assert outs[True] == outs[False]


def test_simulator_shares_real_prompt_ids_only() -> None:
    from tokenslice.sim.simulate import simulate_run
    from tokenslice.bench.workloads import WorkloadRequest
    from tokenslice.config import SchedulerConfig
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.sim.replay import replay
    from tokenslice.predict.cost import load_cost_model

    cost = load_cost_model("opt-13b@a100-40gb")
    shared = list(range(3, 67))  # four full blocks
    real = [WorkloadRequest(f"r{i}", 5.0 * i, None, 70, 8, prompt_token_ids=shared + [100 + i] * 6) for i in range(3)]
    placeholder = [WorkloadRequest(f"p{i}", 5.0 * i, None, 70, 8) for i in range(3)]
    for trace, hits in ((real, 2 * 64), (placeholder, 0)):
        eng = simulated_engine(SchedulerConfig(), cost, kv_cache_blocks=64)
        replay(eng, trace)
        assert eng.scheduler.stats.prefix_cache_device_hits == hits
    def first_tokens(caching: bool) -> list[float]:
        records, _ = simulate_run(cost, real, SchedulerConfig(), 64, enable_prefix_caching=caching)
        return [r.first_token_time - r.arrival for r in records]
    on, off = first_tokens(True), first_tokens(False)
    assert on[0] == off[0] and on[1] < off[1] and on[2] < off[2]  # later ones prefill 6 tokens, not 70
