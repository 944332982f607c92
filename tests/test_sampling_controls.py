"""Sampling controls in the engine: logit_bias, presence / frequency / repetition penalties,
min_p, stop tokens, include_stop_str_in_output and skip_special_tokens, on stories260k and on the
real sampler."""
from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.model.sampler import Sampler
from tokenslice.plan import SeqSlice
from tokenslice.request import InvalidRequestError

PROMPT = "Once upon a time"


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 30, "temperature": 0.0, **kw})


def _slice(rid: str, params: SamplingParams, history: list[int], num_output: int) -> SeqSlice:
    s = SeqSlice(rid, history[-1:], len(history) - 1, [0], True, params, num_output)
    if params.penalized:
        s.history_token_ids = list(history)
    return s


def test_sampler_penalty_arithmetic() -> None:
    """Each row gets exactly its own penalties: OpenAI's presence/frequency over the output,
    repetition (divide positive, multiply negative) over prompt and output."""
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 3)
    plain = _slice("a", greedy(), [0, 1], 0)
    # prompt [1, 2], output [3, 3, 2]
    pf = _slice("b", greedy(presence_penalty=0.5, frequency_penalty=1.0), [1, 2, 3, 3, 2], 3)
    rep = _slice("c", greedy(repetition_penalty=2.0), [1, 2, 3, 3, 2], 3)
    work = logits.clone()
    sampler._apply_penalties(work, [plain, pf, rep])
    assert work[0].tolist() == logits[0].tolist()
    assert work[1].tolist() == [2.0, -1.0, 0.5 - 0.5 - 1.0, 3.0 - 0.5 - 2.0, 0.0]  # prompt-only token 1 untouched
    assert work[2].tolist() == [2.0, -2.0, 0.25, 1.5, 0.0]


def test_sampler_bias_and_min_p_rows() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    biased = _slice("a", greedy(logit_bias={0: 100.0, 3: -100.0}), [1], 0)
    plain = _slice("b", greedy(), [1], 0)
    assert sampler.sample(logits.clone(), [biased, plain]) == [0, 3]
    # min_p 0.3 at temperature 1: p_i / p_max = e^(l_i - 3) >= 0.3 keeps tokens 2 (0.37) and 3 only,
    # renormalised; a greedy row with min_p is still the argmax.
    rows = [_slice("c", SamplingParams(temperature=1.0, min_p=0.3), [1], 0), _slice("d", greedy(min_p=0.3), [1], 0)]
    drawn = [sampler.sample(logits.clone(), rows) for _ in range(2000)]
    assert {d[1] for d in drawn} == {3} and {d[0] for d in drawn} == {2, 3}
    share = sum(d[0] == 2 for d in drawn) / len(drawn)
    assert abs(share - 1 / (1 + math.e)) < 4 * math.sqrt(0.2 / len(drawn))  # 0.269, within 4 sigma


def _frequencies(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int) -> list[float]:
    rows = [_slice(f"r{i}", params, [1], 0) for i in range(n)]
    drawn = sampler.sample(logits.repeat(n, 1), rows)
    return [drawn.count(t) / n for t in range(logits.shape[-1])]


@pytest.mark.parametrize("params, want", [
    (SamplingParams(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
    (SamplingParams(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),  # p^(1/T), renormalised
    (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    (SamplingParams(temperature=1.0, top_p=0.65), [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.4 + 0.3 reaches 0.65
    (SamplingParams(temperature=1.0, min_p=0.5), [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.2 < 0.5 x 0.4
    (SamplingParams(temperature=1.0, top_p=1e-9), [0.0, 0.0, 0.0, 1.0]),  # the top token always stays
])
def test_a_batch_of_draws_follows_the_renormalised_distribution(params: SamplingParams, want: list[float]) -> None:
    # Rows of one batch draw independently: their frequencies are the distribution's.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    got = _frequencies(Sampler(torch.device("cpu"), 3), logits, params, 8000)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 4 * math.sqrt(w * (1 - w) / 8000) + 1e-9, (got, want)


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    others = [SamplingParams(temperature=0.7), greedy(), SamplingParams(temperature=1.3, seed=5, top_k=7)]

    def run(batch: bool) -> list[int]:
        sampler = Sampler(torch.device("cpu"), 0)
        tokens = []
        for step in range(20):
            rows = [_slice("s", seeded, [1], step)]
            if batch:
                rows += [_slice(f"o{i}", p, [1], step) for i, p in enumerate(others)]
            tokens.append(sampler.sample(logits.repeat(len(rows), 1), rows)[0])
        return tokens

    alone = run(False)
    assert run(True) == alone and len(set(alone)) > 1


def test_greedy_rows_take_the_argmax_and_draw_nothing() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    rows = [_slice(f"g{i}", greedy(top_k=3, top_p=0.5), [1], 0) for i in range(5)]
    assert sampler.sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()
    assert not sampler._generators and sampler._unseeded == 0


def test_min_tokens_bans_stop_ids_per_row() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]] * 3)
    early = SeqSlice("a", [1], 0, [0], True, greedy(min_tokens=2, stop_token_ids=[3]), 0, eos_token_id=1)
    done = SeqSlice("b", [1], 0, [0], True, greedy(min_tokens=2, stop_token_ids=[3]), 2, eos_token_id=1)
    ignoring = SeqSlice("c", [1], 0, [0], True, greedy(min_tokens=2, ignore_eos=True), 0, eos_token_id=1)
    assert sampler.sample(logits.clone(), [early, done, ignoring]) == [2, 1, 1]


def test_greedy_text_unchanged_by_neutral_settings(stories_llm: LLM) -> None:
    base = stories_llm.generate(PROMPT, greedy())[0]
    neutral = stories_llm.generate(PROMPT, greedy(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                                  min_p=0.0, logit_bias={}))[0]
    assert neutral.token_ids == base.token_ids and neutral.text == base.text


def test_logit_bias_bans_and_forces(stories_llm: LLM) -> None:
    base = stories_llm.generate(PROMPT, greedy())[0].token_ids
    banned = stories_llm.generate(PROMPT, greedy(logit_bias={base[0]: -100.0}))[0].token_ids
    assert base[0] not in banned[:1] and banned != base
    forced = stories_llm.generate(PROMPT, greedy(max_tokens=4, logit_bias={500: 100.0}))[0].token_ids
    assert forced == [500] * 4


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.5),
                                dict(presence_penalty=1.5), dict(repetition_penalty=0.5)])
def test_penalties_change_a_repeating_greedy_output(stories_llm: LLM, kw: dict) -> None:
    base = stories_llm.generate(PROMPT, greedy(max_tokens=60))[0].token_ids
    assert len(set(base)) < len(base)  # the greedy story repeats tokens
    out = stories_llm.generate(PROMPT, greedy(max_tokens=60, **kw))[0].token_ids
    assert out != base
    if kw.get("repetition_penalty", 2.0) > 1.0:  # discouraging repeats yields more distinct tokens
        assert len(set(out)) > len(set(base))


def test_min_p_one_samples_greedily(stories_llm: LLM) -> None:
    base = stories_llm.generate(PROMPT, greedy())[0].token_ids
    for seed in range(3):
        out = stories_llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.5, min_p=1.0, seed=seed))[0]
        assert out.token_ids == base


def test_stop_tokens_and_include_stop_str(stories_llm: LLM) -> None:
    base = stories_llm.generate(PROMPT, greedy())[0]
    tok = base.token_ids[5]
    cut = stories_llm.generate(PROMPT, greedy(stop_token_ids=[tok]))[0]
    kept = stories_llm.generate(PROMPT, greedy(stop_token_ids=[tok], include_stop_str_in_output=True))[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.token_ids == kept.token_ids == base.token_ids[:6]
    assert base.text.startswith(kept.text) and kept.text.startswith(cut.text) and len(kept.text) > len(cut.text)
    by_str = stories_llm.generate(PROMPT, greedy(stop=["Lily"], include_stop_str_in_output=True))[0]
    assert by_str.finish_reason == "stop" and by_str.text == base.text[:base.text.index("Lily") + len("Lily")]


def test_skip_special_tokens(stories_llm: LLM) -> None:
    bos = stories_llm.tokenizer.bos_token_id
    shown = stories_llm.generate(PROMPT, greedy(max_tokens=3, logit_bias={bos: 100.0}, skip_special_tokens=False))[0]
    hidden = stories_llm.generate(PROMPT, greedy(max_tokens=3, logit_bias={bos: 100.0}))[0]
    assert shown.token_ids == hidden.token_ids == [bos] * 3
    assert shown.text == stories_llm.tokenizer.bos_token * 3 and hidden.text == ""


def test_vocab_checked_at_arrival(stories_llm: LLM) -> None:
    for kw, param in ((dict(logit_bias={512: 1.0}), "logit_bias"), (dict(stop_token_ids=[10_000]), "stop_token_ids"),
                      (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(presence_penalty=2.5), "presence_penalty"), (dict(min_p=1.5), "min_p")):
        with pytest.raises(InvalidRequestError) as exc:
            stories_llm.engine.add_request(PROMPT, greedy(**kw))
        assert exc.value.param == param


def test_penalties_survive_batching_prefix_hits_and_recompute() -> None:
    """History comes from the request, not the runner: the same tokens alone, batched with plain
    requests, started from a cached prefix, and after being dropped and recomputed."""
    rng = random.Random(7)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    params = [greedy(max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
              if i % 2 else greedy(max_tokens=40) for i in range(len(prompts))]
    alone_llm = LLM(str(STORIES), max_batch_size=1, enable_prefix_caching=False)
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert alone[1] != alone_llm.generate([prompts[1]], greedy(max_tokens=40))[0].token_ids
    small = LLM(str(STORIES), kv_cache_blocks=14, max_batch_size=4, policy="mlfq", starvation_limit_s=0.01)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    stats = small.engine.scheduler.stats
    assert stats.recomputed_tokens > 0 and stats.prefix_cache_device_hits > 0


def test_cli_generate_penalty_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenslice.cli import main

    common = ["generate", "--model", str(STORIES), "--prompt", PROMPT, "--max-tokens", "40", "--temperature", "0"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--repetition-penalty", "1.5", "--min-p", "0.1"]) == 0
    assert capsys.readouterr().out != plain
    assert main([*common, "--presence-penalty", "9"]) == 2
    assert "presence_penalty" in capsys.readouterr().err


def test_top_p_beyond_the_candidates_uses_the_whole_vocabulary() -> None:
    # A flat distribution: the 256 most likely of 1,000 tokens hold 36% of the mass, top_p asks for
    # half, so the kept prefix (about 400 tokens) reaches past them.
    probs = torch.exp(-torch.arange(1000) / 1000.0)
    probs /= probs.sum()
    cutoff = int((probs.cumsum(0) - probs < 0.5).sum())  # tokens kept: the prefix reaching 0.5
    assert cutoff > 256
    got = _frequencies(Sampler(torch.device("cpu"), 5), probs.log()[None], SamplingParams(temperature=1.0, top_p=0.5),
                       4000)
    drawn = [t for t, f in enumerate(got) if f > 0]
    assert max(drawn) < cutoff and max(drawn) > 256
