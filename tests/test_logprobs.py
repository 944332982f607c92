"""Logprobs on the real engine equal the log-softmax transformers computes on the same checkpoint,
for sampled and prompt tokens, across chunked prefill, preemption with recompute, swaps and
prefix-cache hits; max_tokens=0 computes only the prompt."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.request import InvalidRequestError, TokenLogprobs

TOP = 3
ASK = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)

_RNG = random.Random(1)
LONG = [[1] + [_RNG.randrange(3, 500) for _ in range(50)] for _ in range(6)]
SHORT = [[1] + [_RNG.randrange(3, 500) for _ in range(3)] for _ in range(6)]


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()

    def logprobs(tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: row j is the distribution of the token at j + 1."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return logprobs


def _check(ref, prompt: list[int], out: list[int], sampled: TokenLogprobs | None,
           prompt_lps: TokenLogprobs | None, k: int = TOP) -> None:
    full = prompt + out
    lp = ref(full)
    cases = []
    if prompt_lps is not None:
        assert prompt_lps.token_ids == prompt[1:]  # every prompt position once, in order, none twice
        cases += [(j, prompt_lps, i) for i, j in enumerate(range(len(prompt) - 1))]
    if sampled is not None:
        assert sampled.token_ids == out
        cases += [(len(prompt) - 1 + i, sampled, i) for i in range(len(out))]
    for row, got, i in cases:
        assert abs(got.logprobs[i] - float(lp[row, full[row + 1]])) < 1e-4
        if got is prompt_lps:  # its rank, up to tokens within rounding of it
            mine = lp[row, full[row + 1]]
            assert int((lp[row] > mine + 1e-4).sum()) < got.ranks[i] <= int((lp[row] > mine - 1e-4).sum()) + 1
        else:
            assert got.ranks == []  # not computed for sampled tokens (no API reports them)
        vals, _ = torch.topk(lp[row], k)
        assert len(got.top_token_ids[i]) == k
        assert torch.allclose(torch.tensor(got.top_logprobs[i]), vals, atol=1e-4, rtol=0)
        # The ids listed are the tokens with those log-probabilities (robust to near-ties).
        assert torch.allclose(lp[row, got.top_token_ids[i]], vals, atol=1e-4, rtol=0)


def _run_waves(llm: LLM, params: SamplingParams) -> list:
    eng = llm.engine
    got: dict[str, list[TokenLogprobs]] = {}

    def step() -> None:
        for o in eng.step():
            for acc, part in zip(got.setdefault(o.request_id, [TokenLogprobs(), TokenLogprobs()]),
                                 (o.logprobs, o.prompt_logprobs), strict=True):
                if part is not None:
                    acc.extend(part)

    reqs = [eng.add_request(p, params) for p in LONG]
    for _ in range(5):
        step()
    reqs += [eng.add_request(p, params) for p in SHORT]
    while eng.has_unfinished():
        step()
    return [(r, *got[r.request_id]) for r in reqs]


def test_greedy_logprobs_match_transformers_with_chunked_prefill(reference):
    # 16 tokens per step: the 51-token prompts are computed in 4 chunks, batched with others.
    with LLM(str(STORIES), dtype="float32", max_tokens_per_step=16) as llm:
        outs = llm.generate(LONG[:3] + SHORT[:3], ASK)
    for p, o in zip(LONG[:3] + SHORT[:3], outs, strict=True):
        _check(reference, p, o.token_ids, o.logprobs, o.prompt_logprobs)
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs.logprobs))


@pytest.mark.parametrize("preemption", ["recompute", "reactive-swap"])
def test_logprobs_survive_preemption(reference, preemption):
    # As tests/test_kv_swap_engine.py: short prompts outrank the long ones, whose KV must go.
    with LLM(str(STORIES), dtype="float32", policy="fixed-priority", preemption=preemption, kv_cache_blocks=14,
             max_batch_size=4, host_kv_blocks=64, eviction_amortization=0.0, max_tokens_per_step=32) as llm:
        results = _run_waves(llm, ASK)
        stats = llm.engine.scheduler.stats
        assert stats.preemptions > 0
        if preemption == "recompute":
            assert stats.recomputed_tokens > 0
        else:
            assert stats.swap_out_bytes > 0 and stats.recomputed_tokens == 0
    for req, sampled, prompt_lps in results:
        _check(reference, req.prompt_token_ids, req.output_token_ids, sampled, prompt_lps)


def test_prompt_logprobs_skip_the_prefix_cache(reference):
    with LLM(str(STORIES), dtype="float32") as llm:
        plain = llm.generate([LONG[0]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
        again = llm.generate([LONG[0]], ASK)[0]  # its prompt blocks are cached: it must compute them anyway
        _check(reference, LONG[0], again.token_ids, again.logprobs, again.prompt_logprobs)
        assert again.token_ids[:2] == plain.token_ids
        assert llm.engine.scheduler.stats.prefix_cache_device_hits == 0


def test_sampled_logprobs_are_raw_whatever_the_logit_processing(reference):
    # Temperature, top-k, a logit bias that makes token 300 win, a repetition penalty: the
    # logprobs still describe the model's own distribution.
    params = SamplingParams(max_tokens=8, temperature=1.7, top_k=5, seed=3, ignore_eos=True, logprobs=0,
                            logit_bias={300: 100.0}, repetition_penalty=1.3, min_tokens=2)
    with LLM(str(STORIES), dtype="float32") as llm:
        out = llm.generate([SHORT[0]], params)[0]
    assert 300 in out.token_ids
    _check(reference, SHORT[0], out.token_ids, out.logprobs, None, k=0)


def test_max_tokens_zero_computes_only_the_prompt(reference):
    with LLM(str(STORIES), dtype="float32", max_tokens_per_step=16) as llm:
        out = llm.generate([LONG[1]], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
        assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
        _check(reference, LONG[1], [], None, out.prompt_logprobs, k=1)
        assert not llm.engine.has_unfinished() and llm.engine.scheduler.kv.device.num_used == 0
        with pytest.raises(InvalidRequestError) as e:  # without prompt logprobs there is nothing to return
            llm.generate([LONG[1]], SamplingParams(max_tokens=0))
        assert e.value.param == "max_tokens"
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([LONG[1]], SamplingParams(logprobs=21))
        assert e.value.param == "logprobs"


def test_logprobs_off_reports_none():
    with LLM(str(STORIES)) as llm:
        out = llm.generate([SHORT[1]], SamplingParams(max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None and out.cumulative_logprob is None


def test_tensor_parallel_reports_the_same_logprobs(reference):
    # -tp 2: the workers' StepResult carries them across to the engine process unchanged.
    with LLM(str(STORIES), dtype="float32", tensor_parallel_size=2) as llm:
        out = llm.generate([LONG[2]], ASK)[0]
    _check(reference, LONG[2], out.token_ids, out.logprobs, out.prompt_logprobs)


def test_a_quantized_head_still_gives_float32_logprobs(reference):
    """An int8 head's logits are bfloat16 (model/quant.py): logprobs come from the file's own head
    weights in float32 instead, so they are never rounded to bfloat16's 1/64 steps."""
    from tokenslice.config import ModelConfig
    from tokenslice.model.loader import load_model
    from tokenslice.model.logprobs import float32_logits
    from tokenslice.model.quant import QuantizedLinear

    loaded = load_model(ModelConfig(str(STORIES), quantization="int8", device="cpu"), with_tokenizer=False)
    model = loaded.model
    assert isinstance(model.lm_head, QuantizedLinear)
    ref_head = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).lm_head.weight.detach()
    assert torch.equal(model.exact_head_weight, ref_head)
    hidden = torch.randn(5, ref_head.shape[1], generator=torch.Generator().manual_seed(0))
    rounded = model.compute_logits(hidden).float()
    assert torch.equal(rounded, rounded.bfloat16().float())  # what sampling uses: bf16 values
    exact = float32_logits(model, hidden)
    assert exact.dtype == torch.float32
    assert torch.allclose(exact, hidden @ ref_head.T, atol=1e-5, rtol=0)
    assert not torch.equal(exact, exact.bfloat16().float())
    # A float32 model keeps no copy: its head's logits are float32 already.
    plain = load_model(ModelConfig(str(STORIES), quantization="none", device="cpu"), with_tokenizer=False).model
    assert getattr(plain, "exact_head_weight", None) is None


def test_quantized_logprobs_on_the_engine_come_from_the_float32_head():
    """Through the engine, an int8 model's sampled and prompt logprobs are each row's float32
    log-softmax (top-k sorted, sampled token's own value among them); tokens unchanged by asking."""
    prompt = LONG[0][:20]
    plain = dataclasses.replace(ASK, logprobs=None, prompt_logprobs=None)
    with LLM(str(STORIES), quantization="int8", device="cpu") as llm:
        want = llm.generate([prompt], plain)[0].token_ids
        out = llm.generate([prompt], ASK)[0]
    assert out.token_ids == want
    for lps in (out.logprobs, out.prompt_logprobs):
        for i, lp in enumerate(lps.logprobs):
            tops = lps.top_logprobs[i]
            assert tops == sorted(tops, reverse=True) and sum(torch.tensor(tops).exp()) <= 1 + 1e-6
            assert lp <= tops[0] + 1e-6
    assert out.logprobs.token_ids == want
