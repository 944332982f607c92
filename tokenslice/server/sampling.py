"""Request fields -> the engine's SamplingParams. The defaults are SamplingParams' own: the request
models take theirs from it (protocol.SamplingFields), so nothing here restates one."""
from __future__ import annotations

from tokenslice.engine.protocol import EngineInfo
from tokenslice.request import InvalidRequestError, SamplingParams
from tokenslice.server.errors import APIError
from tokenslice.server.protocol import SamplingFields

# Temperatures below this sample greedily: dividing logits by ~0 would overflow to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
# The sampler divides float32 logits by the temperature; one past float32's range becomes inf
# (and -inf/inf is NaN). Sampling at this temperature is already uniform for practical purposes.
MAX_TEMPERATURE = 1e4
# The sampler compares top_p in float32; a smaller top_p rounds to 0 and would drop every token.
# Any top_p this small keeps only the most likely token anyway.
MIN_TOP_P = 1e-6


def sampling_params(body: SamplingFields, info: EngineInfo, max_tokens: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's params for a validated request, clamped to what the model can use. None of its
    sampling fields is None: validation leaves out a null, so the field keeps its default."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if body.temperature < GREEDY_TEMPERATURE else min(body.temperature, MAX_TEMPERATURE),
        top_p=max(body.top_p, MIN_TOP_P), top_k=body.top_k,
        seed=body.seed, stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=logit_bias(body.logit_bias), min_p=body.min_p,
        stop_token_ids=list(body.stop_token_ids), include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
        params.validate()
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    # No request can outgrow the context, so larger limits mean the same; clamping keeps
    # absurd JSON integers out of the policies' arithmetic.
    cap = info.max_model_len
    params.max_tokens = min(params.max_tokens, cap)
    params.min_tokens = min(params.min_tokens, cap)
    # top_k at or past the vocabulary keeps every token; clamped, it also fits the core's 64-bit messages.
    params.top_k = min(params.top_k, info.vocab_size)
    return params


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as string keys (JSON objects have no others)."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):  # int() of a huge digit string is costly
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias")
        out[int(key)] = value
    return out


def check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def check_logprobs(limit: int, **counts: int | None) -> None:
    """Logprob alternatives asked for (by field name) within --max-logprobs, else 400 as vLLM."""
    for param, k in counts.items():
        if k is not None and k > limit:
            raise APIError(400, f"{param} asks for {k} alternatives, more than this server's --max-logprobs "
                                f"{limit}", param=param)
