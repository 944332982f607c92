"""Priority updates at run time over HTTP: POST /v1/requests/{id}/priority on a real server
(`--policy priority`), with the official openai client for the generations."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server
from tokenslice.request import RequestState

MODEL = "builtin:tiny"
PROMPT = "Once upon a time"
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--policy", "priority", "--max-batch-size", "1", "--kv-cache-blocks", "512",
                      "--api-key", KEY, "--no-engine-process") as s:  # reads the scheduler's own state
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key=KEY, max_retries=0, timeout=60)


def set_priority(srv: RunningServer, request_id: str, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(srv.url(f"/v1/requests/{request_id}/priority"), json=body, headers=headers, timeout=30)


def long_stream(client: openai.OpenAI, priority: int, max_tokens: int) -> openai.Stream:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                     extra_body={"ignore_eos": True, "priority": priority})


def test_raising_a_waiting_request_preempts_the_running_one(srv: RunningServer, client: openai.OpenAI) -> None:
    """One batch slot. A runs; B waits behind it with a worse priority. Raising B's priority
    over HTTP makes B the next step's batch: B streams tokens while A is paused (preempted)."""
    sched = srv.engine.scheduler
    a = long_stream(client, 0, 2000)
    a_chunks = iter(a)
    a_id = next(a_chunks).id  # A produced a token: it holds the slot
    b = long_stream(client, 5, 1500)
    b_id = b.response.headers["x-request-id"]  # accepted, so live; it waits behind A
    try:
        r = set_priority(srv, b_id, {"priority": -1})
        assert r.status_code == 200, r.text
        assert r.json() == {"id": b_id, "priority": -1}
        b_chunks = iter(b)
        assert next(b_chunks).id == b_id  # B got the slot
        req_a = sched.requests.get(a_id)
        assert req_a is not None and not req_a.is_finished, "A finished before the update: too slow a machine"
        assert req_a.state is RequestState.PREEMPTED and req_a.metrics.preemptions == 1
        paused_at = req_a.num_output_tokens
        for _ in range(5):
            assert next(b_chunks).choices[0].text is not None
        assert req_a.num_output_tokens == paused_at  # A is paused while B gets tokens
        assert sched.requests[b_id].priority == -1
    finally:
        b.close()
        a.close()


def test_route_errors(srv: RunningServer, client: openai.OpenAI) -> None:
    r = set_priority(srv, "cmpl-nonexistent", {"priority": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_not_found"
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert set_priority(srv, done.id, {"priority": 1}).status_code == 404  # finished: no longer live
    for body in ({"priority": "high"}, {"priority": 1.5}, {}, [1]):
        r = set_priority(srv, "cmpl-x", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    assert set_priority(srv, "cmpl-x", {"priority": "high"}).json()["error"]["param"] == "priority"
    r = set_priority(srv, "cmpl-x", {"priority": 1}, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_ids_are_the_engine_ids(srv: RunningServer, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    try:
        chat_id = next(iter(stream)).id  # the role chunk: sent once the engine accepted it
        assert chat_id.startswith("chatcmpl-")
        r = set_priority(srv, chat_id, {"priority": 3})
        assert r.status_code == 200 and r.json() == {"id": chat_id, "priority": 3}
    finally:
        stream.close()
