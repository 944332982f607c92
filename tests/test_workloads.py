"""Workloads: real datasets and tokenizers from ../shared, synthetic lengths, arrivals, resampling."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.datasets import (DatasetCache, alpaca_pairs, filter_lengths, load_conversations, resolve_dataset,
                                       sharegpt_first_pair, sharegpt_turns)
from tokenslice.bench.lengths import LengthDist, scale_io_ratio
from tokenslice.bench.priority_patterns import (DEFAULT_PRIORITY_LEVELS, PRIORITY_PATTERNS, PriorityPattern,
                                                PriorityUpdates)
from tokenslice.bench.workloads import (WORKLOAD_NAMES, load_workload, make_workload, sample_indices, save_workload,
                                        workload_stats)

SHARED = Path(__file__).resolve().parents[2] / "shared"
DATA = SHARED / "data"
GPT2 = SHARED / "tokenizers" / "gpt2"
QWEN3 = SHARED / "tokenizers" / "qwen3"
ALPACA = DATA / "alpaca_4500.json"
SHAREGPT = DATA / "sharegpt_multiturn_800.json"
SHAREGPT_FIRST = DATA / "sharegpt_first_turn_800.json"


@pytest.fixture(scope="module")
def cache() -> DatasetCache:
    return DatasetCache()


def test_alpaca_matches_published_statistics(cache: DatasetCache) -> None:
    recs = cache.records("alpaca", ALPACA, GPT2)
    assert len(recs) == 4500
    p = np.array([r.prompt_len for r in recs])
    o = np.array([r.output_len for r in recs])
    # ../shared/data/SOURCES.md: input mean 17.9 / median 14, output mean 59.2 / median 44.
    assert p.mean() == pytest.approx(17.9, abs=0.1)
    assert np.median(p) == 14
    assert o.mean() == pytest.approx(59.2, abs=0.1)
    assert np.median(o) == 44
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in recs[:50])
    # Cached: the same list object comes back.
    assert cache.records("alpaca", ALPACA, GPT2) is recs


def test_sharegpt_first_pair_matches_published_statistics(cache: DatasetCache) -> None:
    recs = cache.records("sharegpt", SHAREGPT, GPT2)
    assert len(recs) == 793
    assert np.mean([r.prompt_len for r in recs]) == pytest.approx(186, abs=1)
    assert np.mean([r.output_len for r in recs]) == pytest.approx(355, abs=1)
    assert all(r.conversation_id for r in recs)


def test_qwen3_tokenizer_counts_differently(cache: DatasetCache) -> None:
    gpt2 = cache.records("alpaca", ALPACA, GPT2)
    qwen = cache.records("alpaca", ALPACA, QWEN3)
    assert len(qwen) == len(gpt2)
    assert [r.prompt_len for r in qwen] != [r.prompt_len for r in gpt2]
    assert 10 < np.mean([r.prompt_len for r in qwen]) < 30


def test_prompt_only_file_is_rejected(cache: DatasetCache) -> None:
    with pytest.raises(ValueError, match="no human->gpt pair"):
        cache.records("sharegpt", SHAREGPT_FIRST, GPT2)


def test_conversations(cache: DatasetCache) -> None:
    convs = load_conversations(SHAREGPT)
    assert len(convs) == 793
    turns = np.array([len(c.turns) for c in convs])
    # SOURCES.md: 72% of conversations have more than one human turn, mean 3.6.
    assert (turns > 1).mean() == pytest.approx(0.72, abs=0.03)
    assert turns.mean() == pytest.approx(3.6, abs=0.15)
    grouped = cache.conversation_records(SHAREGPT, GPT2)
    assert [len(g) for g in grouped] == list(turns)
    assert all(rec.turn == i and rec.conversation_id == g[0].conversation_id
               for g in grouped for i, rec in enumerate(g))
    first = cache.records("sharegpt", SHAREGPT, GPT2)
    assert [g[0].prompt_len for g in grouped] == [r.prompt_len for r in first]


def test_text_extraction_rules() -> None:
    assert alpaca_pairs([{"instruction": "Do X.", "input": "", "output": "ok"},
                         {"instruction": "Do Y.", "input": "data", "output": "done"}]) == \
        [("Do X.", "ok"), ("Do Y.\ndata", "done")]
    rec = {"id": "a", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "system", "value": "s"},
                                        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                        {"from": "human", "value": "q2"}, {"from": "human", "value": "q3"},
                                        {"from": "gpt", "value": "a3"}, {"from": "human", "value": "dangling"}]}
    assert sharegpt_first_pair(rec) == ("q1", "a1")
    assert sharegpt_turns(rec) == [("q1", "a1"), ("q3", "a3")]
    assert sharegpt_first_pair({"conversations": [{"from": "human", "value": "q"}]}) is None
    assert sharegpt_first_pair({"conversations": [{"from": "human", "value": "q"},
                                                  {"from": "human", "value": "q"}]}) is None


def test_small_dataset_file_and_directory_resolution(tmp_path: Path, cache: DatasetCache) -> None:
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "Say hi", "input": "", "output": "hi there friend"}] * 3))
    assert resolve_dataset("alpaca", tmp_path) == path
    w = make_workload("alpaca", num_requests=5, dataset=tmp_path, tokenizer=GPT2, cache=cache)
    assert len(w) == 5 and all(r.prompt == "Say hi" and r.prompt_len == 2 and r.output_len == 3 for r in w)
    with pytest.raises(ValueError, match="alpaca_4500.json"):
        resolve_dataset("alpaca", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no sharegpt dataset"):
        resolve_dataset("sharegpt", tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_dataset("sharegpt", tmp_path / "missing.json")


def test_length_filter(cache: DatasetCache) -> None:
    recs = cache.records("sharegpt", SHAREGPT, GPT2)
    kept = filter_lengths(recs)
    assert 0 < len(kept) < len(recs)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048 for r in kept)
    w = make_workload("sharegpt", num_requests=300, dataset=SHAREGPT, tokenizer=GPT2, length_filter=True, cache=cache)
    assert all(r.prompt_len + r.output_len <= 2048 for r in w)


def test_make_workload_dataset_sampling(cache: DatasetCache) -> None:
    kw = dict(dataset=ALPACA, tokenizer=GPT2, cache=cache, rate=4.0, seed=3)
    small = make_workload("alpaca", num_requests=1000, **kw)
    assert len({r.prompt_token_ids and tuple(r.prompt_token_ids) for r in small}) > 900  # without replacement
    texts = [r.prompt for r in small]
    big = make_workload("alpaca", num_requests=9000, **kw)
    assert len(big) == 9000 and len({r.prompt for r in big}) < 4500  # with replacement
    again = make_workload("alpaca", num_requests=1000, **kw)
    assert again == small
    assert [r.prompt for r in make_workload("alpaca", num_requests=1000, **{**kw, "seed": 4})] != texts
    assert [r.request_id for r in small[:3]] == ["req-0", "req-1", "req-2"]
    assert all(r.prompt is not None and len(r.prompt_token_ids) == r.prompt_len for r in small)


def test_sharegpt_multiturn_keeps_conversation_ids(cache: DatasetCache) -> None:
    w = make_workload("sharegpt-multiturn", num_requests=50, dataset=DATA, tokenizer=GPT2, cache=cache)
    ids = {c.conversation_id for c in load_conversations(SHAREGPT)}
    assert all(r.conversation_id in ids and r.turn == 0 for r in w)
    assert all(r.conversation_id is None for r in make_workload("sharegpt", num_requests=5, dataset=DATA,
                                                                tokenizer=GPT2, cache=cache))


def test_caps_and_io_ratio_on_dataset(cache: DatasetCache) -> None:
    w = make_workload("sharegpt", num_requests=400, dataset=SHAREGPT, tokenizer=GPT2, cache=cache,
                      max_tokens_cap=256, max_prompt_len=512)
    assert max(r.output_len for r in w) == 256 and max(r.prompt_len for r in w) <= 512
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in w)
    assert all(r.prompt is None for r in w if r.prompt_len == 512)  # truncated: text no longer matches
    base = make_workload("alpaca", num_requests=2000, dataset=ALPACA, tokenizer=GPT2, cache=cache, seed=1)
    scaled = make_workload("alpaca", num_requests=2000, dataset=ALPACA, tokenizer=GPT2, cache=cache, seed=1,
                           io_ratio=2.0)
    st_b, st_s = workload_stats(base), workload_stats(scaled)
    assert st_s["prompt_mean"] / st_s["output_mean"] == pytest.approx(2.0, rel=0.02)
    assert st_s["prompt_mean"] + st_s["output_mean"] == pytest.approx(st_b["prompt_mean"] + st_b["output_mean"],
                                                                      rel=0.02)
    assert all(r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len for r in scaled)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=5, max_size=200), st.lists(st.integers(1, 3000), min_size=5,
                                                                          max_size=200),
       st.floats(0.05, 20.0))
def test_scale_io_ratio_properties(ins: list[int], outs: list[int], ratio: float) -> None:
    n = min(len(ins), len(outs))
    p, o = np.array(ins[:n]), np.array(outs[:n])
    p2, o2 = scale_io_ratio(p, o, ratio)
    assert (p2 >= 1).all() and (o2 >= 1).all()
    # Shape preserved: order within each side is unchanged.
    assert (np.diff(p2[np.argsort(p, kind="stable")]) >= 0).all()
    # Rounding moves each length by <= 0.5 and clamping to 1 only up: bound the drift in the means.
    a = (p.mean() + o.mean()) * ratio / ((1 + ratio) * p.mean())
    b = (p.mean() + o.mean()) / ((1 + ratio) * o.mean())
    assert abs(p2.mean() - a * p.mean()) <= 1.0
    assert abs(o2.mean() - b * o.mean()) <= 1.0


def test_synthetic_workloads() -> None:
    fixed = make_workload("synthetic-fixed", num_requests=100, input_len=300, output_len=50, rate=None)
    assert all(r.prompt_len == 300 and r.output_len == 50 and r.arrival_time == 0.0 and r.prompt is None
               for r in fixed)
    zipf = make_workload("synthetic-zipf", num_requests=5000, zipf_theta=1.2, min_len=8, max_len=500, seed=1)
    lens = np.array([r.output_len for r in zipf])
    assert lens.min() >= 8 and lens.max() <= 500
    assert np.bincount(lens).argmax() == 8  # rank 1 is the most likely
    logn = make_workload("synthetic-lognormal", num_requests=20000, input_len=200, output_len=100, sigma=0.5,
                         max_len=100_000, seed=2)
    assert np.mean([r.prompt_len for r in logn]) == pytest.approx(200, rel=0.03)
    assert np.mean([r.output_len for r in logn]) == pytest.approx(100, rel=0.03)
    capped = make_workload("synthetic-lognormal", num_requests=2000, output_len=500, sigma=2.0, max_len=1024,
                           max_tokens_cap=700)
    assert max(r.output_len for r in capped) == 700
    custom = make_workload("synthetic-fixed", num_requests=10, output_dist=LengthDist("zipf", theta=2.0, max_len=4))
    assert all(1 <= r.output_len <= 4 for r in custom)


def test_length_dist_errors() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown length distribution"):
        LengthDist("pareto").sample(rng, 3)
    with pytest.raises(ValueError, match="min_len"):
        LengthDist("fixed", min_len=10, max_len=5).sample(rng, 3)


def test_users_and_priorities() -> None:
    w = make_workload("synthetic-fixed", num_requests=500, num_users=4, num_priorities=3, seed=9)
    assert {r.user for r in w} == {"user-0", "user-1", "user-2", "user-3"}
    assert {r.priority for r in w} == {0, 1, 2}


def test_make_workload_errors() -> None:
    with pytest.raises(ValueError, match="synthetic-zipf"):
        make_workload("lmsys", num_requests=1)
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload("alpaca", num_requests=1, dataset=ALPACA)
    with pytest.raises(ValueError, match="dataset"):
        make_workload("sharegpt", num_requests=1, tokenizer=GPT2)
    assert set(WORKLOAD_NAMES) == {"alpaca", "sharegpt", "sharegpt-multiturn", "synthetic-fixed", "synthetic-zipf",
                                   "synthetic-lognormal"}


def test_arrivals_basic() -> None:
    rng = np.random.default_rng(0)
    assert (arrival_times(5, None, 1.0, rng) == 0).all()
    assert (arrival_times(5, float("inf"), 4.0, rng) == 0).all()
    np.testing.assert_allclose(arrival_times(4, 2.0, 0.0, rng), [0.0, 0.5, 1.0, 1.5])
    # CV = 1 is exactly Poisson: the same draws as exponential gaps from the same seed.
    got = arrival_times(1000, 3.0, 1.0, np.random.default_rng(7))
    want = np.concatenate([[0.0], np.cumsum(np.random.default_rng(7).exponential(1 / 3.0, size=999))])
    np.testing.assert_allclose(got, want)
    with pytest.raises(ValueError):
        arrival_times(3, -1.0, 1.0, rng)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, -1.0, rng)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.25, 4.0), st.floats(0.1, 50.0), st.integers(0, 2**32 - 1))
def test_gamma_arrivals_hit_target_rate_and_cv(cv: float, rate: float, seed: int) -> None:
    t = arrival_times(50_001, rate, cv, np.random.default_rng(seed))
    gaps = np.diff(t)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 600), st.integers(0, 2**32 - 1))
def test_resampling_is_deterministic_and_respects_replacement(pool: int, n: int, seed: int) -> None:
    a = sample_indices(pool, n, np.random.default_rng(seed))
    b = sample_indices(pool, n, np.random.default_rng(seed))
    assert (a == b).all() and len(a) == n
    assert ((a >= 0) & (a < pool)).all()
    if n <= pool:
        assert len(set(a.tolist())) == n


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["synthetic-fixed", "synthetic-zipf", "synthetic-lognormal"]), st.integers(0, 1000),
       st.floats(0.5, 4.0))
def test_make_workload_deterministic(name: str, seed: int, cv: float) -> None:
    a = make_workload(name, num_requests=50, rate=3.0, cv=cv, seed=seed)
    assert a == make_workload(name, num_requests=50, rate=3.0, cv=cv, seed=seed)
    assert all(x.arrival_time <= y.arrival_time for x, y in zip(a, a[1:]))


def test_save_load_round_trip(tmp_path: Path, cache: DatasetCache) -> None:
    w = make_workload("sharegpt-multiturn", num_requests=20, rate=1.0, dataset=SHAREGPT, tokenizer=GPT2, cache=cache,
                      num_users=2)
    path = tmp_path / "trace.jsonl"
    save_workload(path, w)
    assert load_workload(path) == w


# ---------------------------------------------------------------- priority patterns (FastSwitch §4)

def _live(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(request_id=f"r{i}") for i in range(n)]


def test_priority_pattern_period_and_validation() -> None:
    assert PriorityPattern("random", update_freq=0.01).period == 100
    assert PriorityPattern("markov", update_freq=0.02).period == 50
    assert PriorityPattern("random", update_freq=1.0).period == 1
    assert PriorityPattern().levels == DEFAULT_PRIORITY_LEVELS
    for bad in (PriorityPattern("zigzag"), PriorityPattern(update_freq=0.0), PriorityPattern(update_freq=2.0),
                PriorityPattern(levels=0), PriorityPattern("markov", markov_stay=1.5)):
        with pytest.raises(ValueError):
            bad.validate()
    assert set(PRIORITY_PATTERNS) == {"random", "markov"}


@pytest.mark.parametrize("kind", PRIORITY_PATTERNS)
def test_priority_updates_are_deterministic_from_the_seed(kind: str) -> None:
    def run(seed: int) -> list[object]:
        gen = PriorityUpdates(PriorityPattern(kind, update_freq=0.1, levels=5, seed=seed))
        reqs = _live(30)
        out: list[object] = [gen.initial(r) for r in reqs]
        ids = [r.request_id for r in reqs]
        for k in range(1, 6):
            out.append(gen.at_iteration(k * gen.period, ids[k:]))  # one request finishes per update
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)
    for x in run(3):
        levels = [x] if isinstance(x, int) else list(x.values())  # type: ignore[union-attr]
        assert all(0 <= v < 5 for v in levels)


def test_random_pattern_is_uniform_and_forgets_finished_requests() -> None:
    gen = PriorityUpdates(PriorityPattern("random", levels=4, seed=0))
    ids = [f"r{i}" for i in range(20_000)]
    new = gen.at_iteration(100, ids)
    assert list(new) == ids
    counts = np.bincount(list(new.values()), minlength=4)
    assert np.all(np.abs(counts / len(ids) - 0.25) < 0.02)
    assert list(gen.at_iteration(200, ids[:3])) == ids[:3]  # only the live ones get a level


def test_markov_pattern_moves_one_level_with_the_stay_probability() -> None:
    gen = PriorityUpdates(PriorityPattern("markov", levels=8, seed=1, markov_stay=0.6))
    reqs = _live(20_000)
    ids = [r.request_id for r in reqs]
    start = {r.request_id: gen.initial(r) for r in reqs}
    counts = np.bincount(list(start.values()), minlength=8)
    assert np.all(np.abs(counts / len(ids) - 1 / 8) < 0.02)  # initial levels: the stationary law
    new = gen.at_iteration(100, ids)
    steps = np.array([new[i] - start[i] for i in ids])
    assert set(np.unique(steps)) <= {-1, 0, 1}
    inner = np.array([0 < start[i] < 7 for i in ids])  # away from the ends every move is possible
    assert abs(np.mean(steps[inner] == 0) - 0.6) < 0.02
    assert abs(np.mean(steps[inner] == 1) - 0.2) < 0.02
    assert all(0 <= v < 8 for v in new.values())
    # The state carries over: a second update moves from the first update's level.
    again = gen.at_iteration(200, ids)
    assert all(abs(again[i] - new[i]) <= 1 for i in ids)


def test_markov_pattern_with_stay_one_never_changes() -> None:
    gen = PriorityUpdates(PriorityPattern("markov", levels=8, seed=2, markov_stay=1.0))
    reqs = _live(50)
    start = {r.request_id: gen.initial(r) for r in reqs}
    assert gen.at_iteration(10, list(start)) == start


def test_user_shares_make_one_heavy_user() -> None:
    from tokenslice.bench.workloads import parse_user_shares

    wl = make_workload("synthetic-fixed", num_requests=2600, rate=10.0, seed=3, user_shares=parse_user_shares("10,1,1,1"))
    counts = {u: sum(1 for r in wl if r.user == u) for u in {r.user for r in wl}}
    assert set(counts) == {"user-0", "user-1", "user-2", "user-3"}
    assert 1800 < counts["user-0"] < 2200  # 10/13 of 2,600 = 2,000
    assert all(100 < counts[u] < 300 for u in ("user-1", "user-2", "user-3"))  # 200 each
    # Same seed, same labels; the lengths and arrivals do not depend on the users.
    again = make_workload("synthetic-fixed", num_requests=2600, rate=10.0, seed=3, user_shares=[10, 1, 1, 1])
    assert [r.user for r in again] == [r.user for r in wl]
    plain = make_workload("synthetic-fixed", num_requests=2600, rate=10.0, seed=3)
    assert [r.arrival_time for r in plain] == [r.arrival_time for r in wl]
    for bad in ([], [1, 0], [1, float("nan")]):
        with pytest.raises(ValueError, match="positive"):
            make_workload("synthetic-fixed", num_requests=5, user_shares=bad)
    with pytest.raises(ValueError, match="2 user shares for 3 users"):
        make_workload("synthetic-fixed", num_requests=5, user_shares=[2, 1], num_users=3)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_user_shares("10,x")
