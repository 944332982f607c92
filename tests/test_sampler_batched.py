"""The batched sampler (model/sampler.py): per-request streams, greedy rows, and the distribution
each random row draws from, alone and in mixed batches. Behaviour only: no timing."""
from __future__ import annotations

import math

import pytest
import torch

from tokenslice.model.sampler import TOP_P_CANDIDATES, Sampler
from tokenslice.plan import SeqSlice
from tokenslice.request import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def _slice(rid: str, params: SamplingParams, num_output: int = 0, eos: int | None = None) -> SeqSlice:
    return SeqSlice(rid, [1], 0, [0], True, params, num_output, eos_token_id=eos)


def _steps(sampler: Sampler, logits: torch.Tensor, rows: list[SeqSlice], steps: int) -> list[list[int]]:
    return [sampler.sample(logits.repeat(len(rows), 1), rows) for _ in range(steps)]


def _close(got: list[float], want: list[float], n: int) -> bool:
    return all(abs(g - w) <= 4 * math.sqrt(w * (1 - w) / n) + 1e-9 for g, w in zip(got, want, strict=True))


LOGITS = torch.randn(1, 500, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=0.9, top_p=0.8, seed=7),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.01, seed=7),
])
def test_a_seeded_row_draws_the_same_alone_and_among_random_and_greedy_rows(params: SamplingParams) -> None:
    alone = [t[0] for t in _steps(Sampler(CPU, 0), LOGITS, [_slice("s", params)], 30)]
    others = [SamplingParams(temperature=0.7), GREEDY, SamplingParams(temperature=1.0, top_p=0.5, seed=3),
              SamplingParams(temperature=2.0, top_k=5), GREEDY]
    for where in (0, 3, 5):  # first, among, last: the rows are reordered and gathered around it
        rows = [_slice(f"o{i}", p) for i, p in enumerate(others)]
        rows.insert(where, _slice("s", params))
        batched = [t[where] for t in _steps(Sampler(CPU, 5), LOGITS, rows, 30)]
        assert batched == alone
    assert len(set(alone)) > 1


def test_unseeded_rows_are_reproducible_per_engine_seed_and_distinct_per_request() -> None:
    rows = [_slice(f"u{i}", SamplingParams(temperature=1.0)) for i in range(3)]
    first = _steps(Sampler(CPU, 1), LOGITS, rows, 20)
    assert _steps(Sampler(CPU, 1), LOGITS, rows, 20) == first
    assert _steps(Sampler(CPU, 2), LOGITS, rows, 20) != first
    per_request = [[t[i] for t in first] for i in range(3)]
    assert len({tuple(r) for r in per_request}) == 3
    # Its own stream: the same tokens with a greedy row put in front of it.
    mixed = _steps(Sampler(CPU, 1), LOGITS, [_slice("g", GREEDY), *rows], 20)
    assert [t[1:] for t in mixed] == first


def test_a_negative_seed_is_its_own_stream() -> None:
    draws = {seed: [t[0] for t in _steps(Sampler(CPU, 0), LOGITS, [_slice("s", SamplingParams(seed=seed))], 20)]
             for seed in (3, -3)}
    assert draws[3] != draws[-3]


def test_forget_drops_a_requests_stream() -> None:
    sampler = Sampler(CPU, 0)
    seeded = _slice("s", SamplingParams(temperature=1.0, seed=9))
    once = _steps(sampler, LOGITS, [seeded], 10)
    sampler.forget(["s"])
    assert _steps(sampler, LOGITS, [seeded], 10) == once


# p = [0.02, 0.04, 0.08, 0.12, 0.24, 0.5]; temperature 0.5 squares it (renormalised); min_p 0.02
# drops what is under 0.02 x 0.25 (the first two); top_k 3 keeps 0.0144, 0.0576, 0.25; top_p
# keeps the smallest prefix of what is left that reaches it.
PROBS = [0.02, 0.04, 0.08, 0.12, 0.24, 0.5]


def _renorm(mass: list[float]) -> list[float]:
    return [m / sum(mass) for m in mass]


@pytest.mark.parametrize("params, want", [
    (SamplingParams(temperature=0.5), _renorm([p * p for p in PROBS])),
    (SamplingParams(temperature=0.5, min_p=0.02), _renorm([0, 0, 0.0064, 0.0144, 0.0576, 0.25])),
    (SamplingParams(temperature=0.5, min_p=0.02, top_k=3), _renorm([0, 0, 0, 0.0144, 0.0576, 0.25])),
    # among the top 3 (0.045, 0.179, 0.776): 0.776 + 0.179 reaches 0.9
    (SamplingParams(temperature=0.5, min_p=0.02, top_k=3, top_p=0.9), _renorm([0, 0, 0, 0, 0.0576, 0.25])),
    # top-p alone over what min_p left (0.019, 0.044, 0.175, 0.761): three reach 0.95
    (SamplingParams(temperature=0.5, min_p=0.02, top_p=0.95), _renorm([0, 0, 0, 0.0144, 0.0576, 0.25])),
    (SamplingParams(temperature=1.0, top_p=0.6), _renorm([0, 0, 0, 0, 0.24, 0.5])),
    (SamplingParams(temperature=1e9, top_k=2), [0, 0, 0, 0, 0.5, 0.5]),  # temperature capped: uniform
])
def test_draws_follow_the_renormalised_distribution_in_a_mixed_batch(params: SamplingParams,
                                                                     want: list[float]) -> None:
    # Rows of the kind under test interleaved with greedy rows and rows of another kind: each kind's
    # frequencies are its own distribution's, and the greedy rows stay the argmax.
    n = 4000
    logits = torch.tensor([PROBS]).log()
    plain = SamplingParams(temperature=1.0)
    kinds = [params, GREEDY, plain]
    rows = [_slice(f"r{i}", kinds[i % 3]) for i in range(3 * n)]
    drawn = Sampler(CPU, 11).sample(logits.repeat(len(rows), 1), rows)
    tested, greedy, other = drawn[0::3], drawn[1::3], drawn[2::3]
    assert set(greedy) == {5}
    assert _close([tested.count(t) / n for t in range(6)], want, n), tested
    assert _close([other.count(t) / n for t in range(6)], PROBS, n)


def test_rows_with_different_top_k_in_one_batch_keep_their_own_k() -> None:
    n = 3000
    kinds = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 2, 4)] + [SamplingParams(temperature=1.0, top_p=0.7)]
    rows = [_slice(f"r{i}", kinds[i % 4]) for i in range(4 * n)]
    drawn = Sampler(CPU, 4).sample(torch.tensor([PROBS]).log().repeat(len(rows), 1), rows)
    wants = [[0, 0, 0, 0, 0, 1.0], _renorm([0, 0, 0, 0, 0.24, 0.5]), _renorm([0, 0, 0.08, 0.12, 0.24, 0.5]),
             _renorm([0, 0, 0, 0, 0.24, 0.5])]
    for j, want in enumerate(wants):
        got = drawn[j::4]
        assert _close([got.count(t) / n for t in range(6)], want, n), (kinds[j], got)


def test_top_p_within_the_candidates_is_a_share_of_the_whole_vocabulary() -> None:
    # p_i ~ e^(-i/100) over 1,000 tokens: the 256 most likely hold 92% of the mass, so they hold the
    # prefix that reaches half of it (69 tokens), which is half of the whole vocabulary's mass.
    probs = torch.exp(-torch.arange(1000) / 100.0)
    probs /= probs.sum()
    cutoff = int((probs.cumsum(0) - probs < 0.5).sum())
    assert probs[:TOP_P_CANDIDATES].sum() > 0.9 and cutoff < TOP_P_CANDIDATES
    rows = [_slice(f"r{i}", SamplingParams(temperature=1.0, top_p=0.5)) for i in range(4000)]
    drawn = Sampler(CPU, 6).sample(probs.log()[None].repeat(len(rows), 1), rows)
    assert set(drawn) == set(range(cutoff))


def test_greedy_rows_equal_the_argmax_with_ties_as_torch() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2))
    logits[0, 10] = logits[0, 900] = logits[0].max() + 1  # a tie: the first index, as torch.argmax
    rows = [_slice(f"g{i}", SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.5)) for i in range(6)]
    assert Sampler(CPU, 0).sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-30, 1e-46])  # 1e-46: zero in float32, yet the top token stays
def test_a_tiny_top_p_keeps_exactly_the_top_token(top_p: float) -> None:
    # Flat logits, so the top token's share is small, on a vocabulary past the candidate count.
    logits = torch.linspace(0.0, 0.01, 4 * TOP_P_CANDIDATES)[None].repeat(300, 1)
    rows = [_slice(f"r{i}", SamplingParams(temperature=1.0, top_p=top_p)) for i in range(300)]
    assert set(Sampler(CPU, 0).sample(logits, rows)) == {4 * TOP_P_CANDIDATES - 1}


def test_min_tokens_bans_stop_and_eos_ids_per_row() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]] * 4)
    rows = [
        _slice("early", SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]), 0, eos=1),  # 1, 2 banned
        _slice("done", SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]), 2, eos=1),
        _slice("no-eos", SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), 0, eos=1),
        _slice("random", SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[3]), 1, eos=1),
    ]
    for step in _steps(Sampler(CPU, 0), logits[:1], rows, 50):
        assert step[:3] == [3, 1, 1] and step[3] in (0, 2)
