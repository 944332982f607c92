"""Schemathesis against the server's own OpenAPI schema: valid and invalid bodies for
/v1/completions and /v1/chat/completions. No 5xx, ever; every 4xx carries the error object.
A second fuzz sends valid combinations of the sampling controls in concurrent batches: all 200.

Kept cheap so it runs in CI: a 64-token context bounds every generation, whatever max_tokens
the fuzzer picks. Derandomized, so CI runs the same cases every time; to hunt for new bugs, run
it locally with derandomize=False and more examples."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                              status_code_conformance)

from serverkit import RunningServer, start_server

EXAMPLES_PER_OPERATION = 150  # x 2 operations = 300 cases


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "32", "--max-model-len", "64", "--max-batch-size", "8") as s:
        yield s


@schemathesis.check
def openai_error_object(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                        case: schemathesis.Case) -> bool | None:
    if 400 <= response.status_code < 500:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict), f"4xx without an error object: {response.text[:300]}"
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_openapi(srv: RunningServer, path: str) -> None:
    schema = schemathesis.openapi.from_url(srv.url("/openapi.json"))
    op = schema[path]["POST"]
    cases = st.one_of(op.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      op.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=srv.base_url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance,
                                                 openai_error_object])

    run()
    assert len(statuses) >= EXAMPLES_PER_OPERATION
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert httpx.get(srv.url("/health")).status_code == 200


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([lo, hi]), st.floats(lo, hi, allow_nan=False))


@pytest.mark.slow
def test_fuzz_sampling_controls(srv: RunningServer) -> None:
    """Valid combinations of every sampling control, at and inside their bounds, in batches of
    concurrent requests: each one is answered 200 (never an engine fault that fails the batch)."""
    vocab = srv.info.vocab_size
    token = st.integers(0, vocab - 1)
    controls = st.fixed_dictionaries({}, optional={
        "temperature": st.one_of(st.just(0.0), _floats(1e-6, 1e4)),
        "top_p": _floats(1e-9, 1.0),
        "top_k": st.integers(-1, vocab + 5),
        "min_p": _floats(0.0, 1.0),
        "presence_penalty": _floats(-2.0, 2.0),
        "frequency_penalty": _floats(-2.0, 2.0),
        "repetition_penalty": _floats(1e-4, 1e4),
        "logit_bias": st.dictionaries(token.map(str), _floats(-100.0, 100.0), max_size=8),
        "stop_token_ids": st.lists(token, max_size=4),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "min_tokens": st.integers(0, 4),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
        "seed": st.integers(0, 2**32),
    })

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(controls, min_size=1, max_size=4))
    def run(batch: list[dict]) -> None:
        async def send() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(srv.url("/v1/completions"), json={
                    "prompt": "Once upon a time", "max_tokens": 8, **body}) for body in batch))

        for body, r in zip(batch, asyncio.run(send()), strict=True):
            assert r.status_code == 200, (body, r.text[:300])

    run()
    assert httpx.get(srv.url("/health")).status_code == 200
