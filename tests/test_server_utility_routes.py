"""Routes vLLM clients probe besides generation: /v1/models/{id}, /tokenize, /detokenize,
/version and /ping, on a real server, with and without --api-key."""
from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server

MODEL = "builtin:tiny"
KEY = "util-key"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "32", "--max-model-len", "128") as s:
        yield s


def test_model_by_id(srv: RunningServer) -> None:
    c = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=30)
    m = c.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.model_extra["max_model_len"] == 128
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


def test_tokenize_prompt_matches_the_tokenizer(srv: RunningServer) -> None:
    tok = srv.tokenizer
    r = httpx.post(srv.url("/tokenize"), json={"model": MODEL, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": 128,
                    "tokens": tok("Once upon a time")["input_ids"]}
    plain = httpx.post(srv.url("/tokenize"), json={"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok("Once upon a time", add_special_tokens=False)["input_ids"]


def test_tokenize_messages_is_what_chat_feeds_the_engine(srv: RunningServer) -> None:
    tok = srv.tokenizer
    for gen in (True, False):
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        r = httpx.post(srv.url("/tokenize"), json={"messages": MESSAGES, "add_generation_prompt": gen})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    # The count is the chat route's prompt_tokens.
    chat = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MESSAGES, "max_tokens": 1}, timeout=60)
    count = httpx.post(srv.url("/tokenize"), json={"messages": MESSAGES}).json()["count"]
    assert chat.json()["usage"]["prompt_tokens"] == count


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"), ({"prompt": "hi", "messages": MESSAGES}, "prompt"), ({"prompt": 5}, "prompt"),
])
def test_tokenize_bad_bodies_are_400(srv: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(srv.url("/tokenize"), json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    other = httpx.post(srv.url("/tokenize"), json={"prompt": "hi", "model": "other"})  # an unknown model: 404
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found", other.text


def test_detokenize_round_trip_and_out_of_vocabulary(srv: RunningServer) -> None:
    tok = srv.tokenizer
    ids = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    r = httpx.post(srv.url("/detokenize"), json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    for bad in ([srv.info.vocab_size], [-1], [0, 10**30]):
        r = httpx.post(srv.url("/detokenize"), json={"tokens": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "tokens"


def test_version_and_ping(srv: RunningServer) -> None:
    r = httpx.get(srv.url("/version"))
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("tokenslice")}
    assert httpx.get(srv.url("/ping")).status_code == 200
    assert httpx.post(srv.url("/ping")).status_code == 200


def test_api_key_guards_tokenizer_routes_but_not_probes() -> None:
    with start_server("--kv-cache-blocks", "16", "--api-key", KEY) as s:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(s.url(path), json=body).status_code == 401
            assert httpx.post(s.url(path), json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(s.url(f"/v1/models/{MODEL}")).status_code == 401
        assert httpx.get(s.url(f"/v1/models/{MODEL}"), headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        for path in ("/ping", "/version", "/health"):
            assert httpx.get(s.url(path)).status_code == 200, path
