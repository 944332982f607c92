"""Schemathesis against the server's own OpenAPI schema: valid and invalid bodies for
/v1/completions and /v1/chat/completions. No 5xx, ever; every 4xx carries the error object.
A second fuzz sends valid combinations of the sampling controls in concurrent batches: all 200.
A third sends only schema-valid requests to the API operations: none is refused for its shape
(the schema and the validators agree); regression tests pin each disagreement found so far.

Kept cheap so it runs in CI: a 64-token context bounds every generation, whatever max_tokens
the fuzzer picks. Derandomized, so CI runs the same cases every time; to hunt for new bugs, run
it locally with derandomize=False and more examples."""
from __future__ import annotations

import asyncio
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from fastapi.openapi.utils import get_openapi
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


def run_cases(srv: RunningServer, cases: st.SearchStrategy[schemathesis.Case], examples: int,
              also: Callable[[schemathesis.Case, schemathesis.Response], None] | None = None) -> list[int]:
    """Send `examples` derandomized cases to the server, each answer checked against the schema
    (no 5xx, documented status and content, OpenAI's error object) and by `also`; their statuses."""
    statuses: list[int] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=srv.base_url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance,
                                                 openai_error_object])
        if also is not None:
            also(case, response)

    run()
    return statuses


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_openapi(srv: RunningServer, path: str) -> None:
    schema = schemathesis.openapi.from_url(srv.url("/openapi.json"))
    op = schema[path]["POST"]
    cases = st.one_of(op.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      op.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    statuses = run_cases(srv, cases, EXAMPLES_PER_OPERATION)
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


# --- the schema and the validators agree ------------------------------------------------------

# (method, path, examples): sized so that all of them take well under a minute on 2 cores.
SCHEMA_OPERATIONS = (("POST", "/tokenize", 100), ("POST", "/detokenize", 60), ("POST", "/v1/completions", 150),
                     ("POST", "/v1/chat/completions", 150), ("POST", "/v1/requests/{request_id}/priority", 30),
                     ("GET", "/v1/models/{model_id}", 10))
GENERATION = ("/v1/completions", "/v1/chat/completions")
PRIORITY = "/v1/requests/{request_id}/priority"
MESSAGES = [{"role": "user", "content": "Say hi."}]


STRUCTURED_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "guided_decoding_backend", "tools", "tool_choice", *(f"structured_outputs.{f}" for f in (
                         "json", "regex", "choice", "grammar", "json_object", "structural_tag")))


@dataclass(frozen=True)
class Allowed4xx:
    """A 4xx that a schema-valid request may still get (matched by status, the error's param or
    code, and its message), and why no schema can rule it out."""

    paths: tuple[str, ...]
    status: int
    params: tuple[str, ...]
    message: str  # a regex the error message starts with
    why: str

    def allows(self, path: str, status: int, error: dict[str, Any]) -> bool:
        return (path in self.paths and status == self.status and (error["param"] or error["code"]) in self.params
                and re.match(self.message, error["message"]) is not None)


ALLOWED_4XX = (
    Allowed4xx((PRIORITY,), 404, ("request_not_found",), "no live request ",
               "state: no live request has that id"),
    Allowed4xx(GENERATION, 400, ("prompt", "messages"), r"(prompt|messages) has \d+ (tokens|characters)",
               "how many tokens a text (or the chat template's rendering) makes: it must fit the context"),
    Allowed4xx(GENERATION, 400, ("max_tokens", "max_completion_tokens"), r"this model's context is \d+ tokens",
               "the prompt's token count plus max_tokens must fit the context"),
    Allowed4xx(GENERATION, 400, ("min_tokens",), r"min_tokens must be in \[0, max_tokens=\d+\]",
               "one field bounded by another: min_tokens <= max_tokens (or its default)"),
    Allowed4xx(("/v1/completions",), 400, ("best_of",), r"best_of (must be at least n|> n cannot be streamed)",
               "one field bounded by another: best_of >= n, and best_of == n when streamed"),
    Allowed4xx(GENERATION, 400, ("n", "prompt"), r"this request makes \d+ engine requests",
               "one field bounded by another: prompts x n within --max-waiting"),
    Allowed4xx(("/tokenize",), 400, ("messages",), r"messages has \d+ characters",
               "how long a chat template renders messages (tool calls included) is not a schema property"),
    Allowed4xx(GENERATION, 400, STRUCTURED_PARAMS, r"(response_format|structured_outputs\.\w+|guided_\w+|tools): ",
               "whether xgrammar compiles a schema, regex or grammar, and how long it is as text, is not a JSON "
               "Schema property"),
    Allowed4xx(GENERATION, 400, STRUCTURED_PARAMS,
               r"([\w.]+: only one structured-output constraint|[\w.]+ cannot be combined with tools)",
               "fields that exclude each other: one structured-output constraint per request"),
    Allowed4xx(("/v1/chat/completions",), 400, ("tools", "tool_choice"),
               r"(tools: each function needs its own name|tool_choice names function)",
               "names that must match across fields: tools unique, tool_choice one of them"),
)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "examples"), SCHEMA_OPERATIONS, ids=[p for _, p, _ in SCHEMA_OPERATIONS])
def test_schema_valid_requests_are_not_refused(srv: RunningServer, method: str, path: str, examples: int) -> None:
    """Schemathesis in positive mode: every request the schema allows is answered 2xx, or with one
    of ALLOWED_4XX (what depends on state or cannot be said in JSON Schema)."""
    op = schemathesis.openapi.from_url(srv.url("/openapi.json"))[path][method]
    def only_allowed_4xx(case: schemathesis.Case, response: schemathesis.Response) -> None:
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            assert any(a.allows(path, response.status_code, error) for a in ALLOWED_4XX), (
                f"schema-valid request refused: {response.status_code} {error}\n{case.as_curl_command()[:1000]}")

    statuses = run_cases(srv, op.as_strategy(schemathesis.GenerationMode.POSITIVE), examples, only_allowed_4xx)
    assert statuses
    if path != PRIORITY:  # no request is live, so every priority change is a 404
        assert 200 in statuses, sorted(set(statuses))


@pytest.fixture(scope="module")
def spec(srv: RunningServer) -> dict[str, Any]:
    return httpx.get(srv.url("/openapi.json")).json()


def schema_allows(spec: dict[str, Any], component: str, body: Any) -> bool:
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{component}",
                                                 "components": spec["components"]})
    return validator.is_valid(body)


def check_agreement(srv: RunningServer, spec: dict[str, Any], path: str, component: str, body: Any,
                    allowed: bool, status: int | None = None, param: str | None = None) -> None:
    """Whether the schema allows `body`, and the server's answer: `status` when given (a state
    the schema cannot know), else 200 when allowed and 400 when not; any refusal carries the
    error object, naming `param` when given."""
    assert schema_allows(spec, component, body) == allowed, (path, body)
    r = httpx.post(srv.url(path), json=body, timeout=60)
    assert r.status_code == (status or (200 if allowed else 400)), (path, body, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert param is None or r.json()["error"]["param"] == param, (path, body, r.text)


def test_tokenize_schema_needs_exactly_one_of_prompt_and_messages(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding: `{}` was schema-valid, yet the handler answers 400 (as vLLM)."""
    for body in ({}, {"prompt": None, "messages": None}, {"prompt": "hi", "messages": MESSAGES}):
        check_agreement(srv, spec, "/tokenize", "TokenizeRequest", body, False, param="prompt")
    for body in ({"prompt": "hi"}, {"messages": MESSAGES}, {"prompt": "hi", "messages": None},
                 {"prompt": None, "messages": MESSAGES}):
        check_agreement(srv, spec, "/tokenize", "TokenizeRequest", body, True)


def test_detokenize_schema_bounds_token_ids_to_the_vocabulary(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding: ids above 2**63 - 1 were schema-valid (FastAPI writes that bound as the float
    2**63). Any id outside the vocabulary, however large, is a 400 with the error object."""
    top = srv.info.vocab_size - 1
    tokens = spec["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": top}
    check_agreement(srv, spec, "/detokenize", "DetokenizeRequest", {"tokens": [0, top]}, True)
    for bad in (top + 1, -1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e300):
        check_agreement(srv, spec, "/detokenize", "DetokenizeRequest", {"tokens": [bad]}, False, param="tokens")
    # JSON numbers Python reads as infinities, or as integers past its digit limit.
    for raw in ('{"tokens": [1e400]}', '{"tokens": [-1e400]}', '{"tokens": [%s]}' % ("9" * 5000)):
        r = httpx.post(srv.url("/detokenize"), content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]


def test_chat_schema_ties_top_logprobs_to_logprobs(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding: top_logprobs without `logprobs: true` was schema-valid; the 400 stays (as OpenAI and vLLM)."""
    chat = {"messages": MESSAGES, "max_tokens": 2}
    for extra in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False}, {"top_logprobs": 0, "logprobs": None}):
        check_agreement(srv, spec, "/v1/chat/completions", "ChatCompletionRequest", {**chat, **extra}, False,
                        param="top_logprobs")
    for extra in ({"top_logprobs": 2, "logprobs": True}, {"top_logprobs": None}, {"logprobs": True}):
        check_agreement(srv, spec, "/v1/chat/completions", "ChatCompletionRequest", {**chat, **extra}, True)


def test_completions_schema_allows_max_tokens_0_only_with_echo(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding (schemathesis, positive mode): `max_tokens: 0` without echo was schema-valid."""
    for extra in ({}, {"echo": False}, {"echo": None}):
        check_agreement(srv, spec, "/v1/completions", "CompletionRequest", {"prompt": "hi", "max_tokens": 0, **extra},
                        False, param="max_tokens")
    check_agreement(srv, spec, "/v1/completions", "CompletionRequest",
                    {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1}, True)


def test_priority_schema_follows_the_policy(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding (schemathesis, positive mode): any priority was schema-valid, but a policy that does
    not schedule by priority refuses all but 0 (400 before looking the request up)."""
    path = "/v1/requests/no-such-request/priority"
    check_agreement(srv, spec, path, "PriorityUpdate", {"priority": 5}, False, param="priority")
    check_agreement(srv, spec, path, "PriorityUpdate", {"priority": 0}, True, status=404)
    with start_server("--kv-cache-blocks", "16", "--max-model-len", "64", "--policy", "priority") as s:
        schema = httpx.get(s.url("/openapi.json")).json()
        assert schema_allows(schema, "PriorityUpdate", {"priority": -5})
        r = httpx.post(s.url(path), json={"priority": -5}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found", r.text


def test_null_means_the_default_in_schema_and_validators(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding: `add_generation_prompt: null` was accepted (null means the default, for every
    optional field) but not in the schema. Now the schema takes null for each optional field of
    every request model; a required one still refuses it."""
    minimal = {"CompletionRequest": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
               "ChatCompletionRequest": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
               "TokenizeRequest": ("/tokenize", {"messages": MESSAGES}),
               "DetokenizeRequest": ("/detokenize", {"tokens": [1]})}
    for component, (path, body) in minimal.items():
        props = spec["components"]["schemas"][component]["properties"]
        nulls = {name: None for name in props if name not in body}
        assert schema_allows(spec, component, {**body, **nulls}), component
        r = httpx.post(srv.url(path), json={**body, **nulls}, timeout=60)
        assert r.status_code == 200, (component, r.text[:300])
        for name in spec["components"]["schemas"][component].get("required", ()):
            check_agreement(srv, spec, path, component, {**body, name: None}, False, param=name)
    # add_generation_prompt: null renders as true, its default.
    tokens = {gen: httpx.post(srv.url("/tokenize"), json={"messages": MESSAGES, "add_generation_prompt": gen}).json()
              for gen in (None, True, False)}
    assert tokens[None] == tokens[True] != tokens[False]


def test_ping_405_allows_both_methods(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Finding: /ping is one route per method (each its own operation id), so OPTIONS got a 405
    whose Allow named GET only."""
    for method in ("OPTIONS", "PUT", "DELETE", "PATCH"):
        r = httpx.request(method, srv.url("/ping"))
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}, (method, r.headers)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(srv.url("/ping")).status_code == 200 and httpx.post(srv.url("/ping")).status_code == 200
    assert set(spec["paths"]["/ping"]) == {"get", "post"}
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        get_openapi(title="tokenslice", version="0", routes=srv.app.routes)


def test_schema_and_validators_agree_on_other_findings(srv: RunningServer, spec: dict[str, Any]) -> None:
    """Further disagreements a positive-mode run found: each body is schema-valid exactly when the
    server takes it."""
    vocab, context = srv.info.vocab_size, srv.info.max_model_len
    cmpl = ("/v1/completions", "CompletionRequest", {"prompt": "hi", "max_tokens": 2})
    chat = ("/v1/chat/completions", "ChatCompletionRequest", {"messages": MESSAGES, "max_tokens": 2})
    cases: list[tuple[tuple[str, str, dict[str, Any]], dict[str, Any], bool, str]] = [
        # FastAPI writes seed's bound 2**64 - 1 as the float 2**64.
        (cmpl, {"seed": 2**64 - 1}, True, ""), (cmpl, {"seed": 2**64}, False, "seed"),
        (cmpl, {"logit_bias": {str(vocab - 1): 1}}, True, ""),
        (cmpl, {"logit_bias": {str(vocab): 1}}, False, "logit_bias"),
        (cmpl, {"stream_options": {"include_usage": True}}, False, "stream_options"),
        (chat, {"stream_options": {"include_usage": True}}, False, "stream_options"),
        # No prompt is empty, so no request can generate a whole context.
        (cmpl, {"max_tokens": context}, False, "max_tokens"),
        (chat, {"max_completion_tokens": context}, False, "max_completion_tokens"),
        (cmpl, {"min_tokens": context}, False, "min_tokens"),
        (cmpl, {"prompt": [1] * context}, False, "prompt"),
        (cmpl, {"prompt": ["hi"] * (srv.server.settings.max_prompts_per_request + 1)}, False, "prompt"),
        (cmpl, {"stream": True, "prompt_logprobs": 1}, False, "prompt_logprobs"),
        (cmpl, {"stream": True, "prompt_logprobs": 1, "echo": True, "logprobs": 1}, True, ""),
        (("/tokenize", "TokenizeRequest", {"prompt": "hi"}), {"prompt": ""}, False, "prompt"),
    ]
    for (path, component, body), extra, allowed, param in cases:
        check_agreement(srv, spec, path, component, {**body, **extra}, allowed, param=param or None)
    # A model the server does not serve: outside the schema, and a (documented) 404.
    for component, path, body in (("TokenizeRequest", "/tokenize", {"prompt": "hi"}),
                                  ("DetokenizeRequest", "/detokenize", {"tokens": [1]})):
        check_agreement(srv, spec, path, component, {**body, "model": "other"}, False, status=404)
    [model_id] = spec["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert model_id["schema"]["enum"] == list(srv.server.settings.model_names)
    assert httpx.get(srv.url("/v1/models/other")).status_code == 404
