"""Inputs found by fuzzing the HTTP API: each answered with a clean 4xx, the connection kept."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serverkit import RunningServer, start_server

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "32", "--max-model-len", "64") as s:
        yield s


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["hi \\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": "\\ud800", "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}',
     "messages"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 2}',
     "messages"),
])
def test_lone_surrogate_is_400_and_keeps_the_connection(srv: RunningServer, path: str, body: bytes,
                                                         param: str) -> None:
    with httpx.Client(timeout=60) as c:
        r = c.post(srv.url(path), content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert "\ud800" not in r.text and "there" not in r.text  # the prompt is never echoed
        # The same kept-alive connection serves the next request.
        r = c.post(srv.url("/v1/completions"), json={"prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_openapi_does_not_reveal_the_model_path() -> None:
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "16") as s:
        schema = httpx.get(s.url("/openapi.json"), timeout=30).text
        assert str(STORIES) not in schema and "stories260k" not in schema
        # Clients still see and send the name the server answers to.
        [card] = httpx.get(s.url("/v1/models"), timeout=30).json()["data"]
        r = httpx.post(s.url("/v1/completions"), json={"model": card["id"], "prompt": "Once", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(s.url(f"/v1/models/{card['id']}"), timeout=30).json()["id"] == card["id"]


def test_openapi_names_a_plain_model_name(srv: RunningServer) -> None:
    props = httpx.get(srv.url("/openapi.json")).json()["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"type": "string", "enum": ["builtin:tiny"]} in props["model"]["anyOf"]


def test_every_error_answer_is_counted(srv: RunningServer) -> None:
    """tokenslice:request_rejected_total{status} counts each 4xx and 5xx, from whichever layer answers."""
    key = 'tokenslice:request_rejected_total{model_name="builtin:tiny",status="%d"}'
    before = srv.metrics()
    with httpx.Client(timeout=60) as c:
        assert c.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": -1}).status_code == 400
        assert c.post(srv.url("/v1/completions"), json={"prompt": "hi", "n": 0}).status_code == 400
        assert c.get(srv.url("/v1/models/unknown")).status_code == 404
        assert c.get(srv.url("/no/such/route")).status_code == 404
        assert c.get(srv.url("/v1/completions")).status_code == 405
        assert c.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    after = srv.metrics()

    def delta(status: int) -> float:
        return after.get(key % status, 0.0) - before.get(key % status, 0.0)

    assert (delta(400), delta(404), delta(405)) == (2, 2, 1)


def test_key_and_body_limit_refusals_are_counted() -> None:
    key = 'tokenslice:request_rejected_total{model_name="builtin:tiny",status="%d"}'
    with start_server("--kv-cache-blocks", "16", "--api-key", "k", "--max-body-bytes", "1000") as s:
        assert httpx.get(s.url("/v1/models")).status_code == 401
        big = {"prompt": "x" * 2000}
        assert httpx.post(s.url("/v1/completions"), json=big, headers={"Authorization": "Bearer k"}).status_code == 413
        m = s.metrics()
        assert m[key % 401] == 1 and m[key % 413] == 1


def test_unexpected_error_is_500_and_keeps_the_connection(srv: RunningServer) -> None:
    """A bug in a handler answers the 500 error object; the kept-alive connection survives it."""
    async def broken() -> None:
        raise RuntimeError("a bug")

    srv.app.add_api_route("/test-only/broken", broken)
    with httpx.Client(timeout=60) as c:
        r = c.get(srv.url("/test-only/broken"))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "a bug" not in r.text
        r = c.post(srv.url("/v1/completions"), json={"prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 200
