"""--api-key: every /v1/* route needs `Authorization: Bearer KEY`; /health and /metrics stay open."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server

KEY = "test-key-123"
MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "16", "--api-key", KEY) as s:
        yield s


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
