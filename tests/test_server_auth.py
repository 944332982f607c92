"""--api-key: every route but the public ones (/health, /ping, /version, /metrics, the page and the
API's description) needs `Authorization: Bearer KEY`, whether the server is reached directly, with
--root-path as a prefix-stripping proxy forwards to it, or through such a proxy (serverkit.REACH_MODES)."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from serverkit import REACH_MODES, RunningServer, server_reached

KEY = "test-key-123"
MODEL = "builtin:tiny"
HTTP_TIMEOUT_S = 60.0  # a failure deadline, not a performance check


@pytest.fixture(scope="module", params=REACH_MODES)
def srv(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with server_reached(request.param, "--kv-cache-blocks", "16", "--api-key", KEY) as s:
        yield s


# Every route that is not public, some unknown paths, and odd spellings of keyed paths.
KEYED = [("GET", "/v1/models"), ("GET", "/v1/state"), ("GET", "/v1/state/stream"), ("POST", "/v1/completions"),
         ("POST", "/v1/chat/completions"), ("POST", "/v1/requests/cmpl-1/priority"), ("POST", "/tokenize"),
         ("POST", "/detokenize"), ("GET", "/tokenizer_info"), ("GET", "/v1"), ("GET", "/"), ("GET", "/nope"),
         ("GET", "/v1/../v1/state"), ("GET", "//v1/state"), ("GET", "/V1/state"), ("OPTIONS", "/v1/completions"),
         ("GET", "/dashboard/static"), ("GET", "/healthz")]
PUBLIC = ["/health", "/ping", "/version", "/metrics", "/dashboard", "/dashboard/static/dashboard.js",
          "/openapi.json", "/docs"]


@pytest.mark.parametrize("method,path", KEYED)
def test_every_route_but_the_public_ones_needs_the_key(srv: RunningServer, method: str, path: str) -> None:
    r = httpx.request(method, srv.url(path), json={"prompt": "hi", "max_tokens": 2, "tokens": [1]})
    assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
    assert r.json()["error"]["code"] == "invalid_api_key"
    with httpx.stream(method, srv.url(path), headers={"Authorization": f"Bearer {KEY}"}, timeout=HTTP_TIMEOUT_S,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "tokens": [1], "priority": 0}) as r:
        assert r.status_code != 401, (method, path)  # the status only: /v1/state/stream never ends


@pytest.mark.parametrize("path", PUBLIC)
def test_public_routes_need_no_key(srv: RunningServer, path: str) -> None:
    assert httpx.get(srv.url(path)).status_code == 200


def test_two_authorization_headers_are_400(srv: RunningServer) -> None:
    """A proxy that checks the first and a server that takes the last would disagree on who asks."""
    for pair in ([KEY, "wrong"], ["wrong", KEY], [KEY, KEY]):
        headers = [("Authorization", f"Bearer {k}") for k in pair]
        r = httpx.get(srv.url("/v1/models"), headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_authorization", (pair, r.text)
    assert httpx.get(srv.url("/health"), headers=[("Authorization", "a"), ("Authorization", "b")]).status_code == 400


def _calls(c: openai.OpenAI) -> list:
    return [
        lambda: c.models.list(),
        lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2),
        lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True),
        lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2),
    ]


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Bearer {KEY}x", KEY, f"Basic {KEY}"])
def test_missing_or_wrong_key_is_401_on_every_v1_route(srv: RunningServer, auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/unknown"), ("POST", "/v1/completions?x=1")]:
        r = httpx.request(method, srv.url(path), headers=headers, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if auth is not None and auth.startswith("Bearer "):  # the SDK always sends "Bearer <key>"
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key=auth.removeprefix("Bearer "), max_retries=0)
        for call in _calls(c):
            with pytest.raises(openai.AuthenticationError) as exc:
                call()
            assert exc.value.status_code == 401


def test_right_key_works(srv: RunningServer) -> None:
    c = openai.OpenAI(base_url=srv.url("/v1"), api_key=KEY, max_retries=0)
    for call in _calls(c):
        call()
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_health_and_metrics_stay_open(srv: RunningServer) -> None:
    assert httpx.get(srv.url("/health")).status_code == 200
    r = httpx.get(srv.url("/metrics"))
    assert r.status_code == 200 and "tokenslice:num_requests_running" in r.text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(srv: RunningServer, scheme: str) -> None:
    """RFC 7235: auth schemes are case-insensitive; the key itself is not."""
    r = httpx.get(srv.url("/v1/models"), headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    r = httpx.get(srv.url("/v1/models"), headers={"Authorization": f"{scheme} {KEY.upper()}"})
    assert r.status_code == 401
