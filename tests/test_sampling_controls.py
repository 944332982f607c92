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
    # min_p 0.3 at temperature 1: p_i / p_max = e^(l_i - 3) >= 0.3 keeps tokens 2 (0.37) and 3 only.
    work = logits.clone()
    keep = SamplingParams(temperature=1.0, min_p=0.3)
    sampler._apply_min_p(work, [_slice("c", keep, [1], 0), _slice("d", greedy(min_p=0.3), [1], 0)])
    assert work[0].tolist() == [-math.inf, -math.inf, 2.0, 3.0]


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
