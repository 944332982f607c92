"""The live view's data: /v1/state and its SSE stream (server/state.py) with the engine core in
its own process and on a thread, behind --api-key. No prompt text ever reaches the state (a
canary string checks it)."""
from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server, until, wait_idle
from tokenslice.server.state import encode

MODEL = "builtin:tiny"
DEADLINE_S = 60.0  # failure deadlines, not performance checks
CANARY = "zebra-canary-7f3a"
STATES = {"waiting", "running", "preempted", "swapping", "on host", "to recompute"}


def _state(srv: RunningServer, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(srv.url("/v1/state"), headers=headers, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert CANARY not in r.text
    return _strict_json(r.text)


def _strict_json(text: str) -> dict:
    """As a browser parses it: no Infinity or NaN."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _sse_events(srv: RunningServer, n: int, headers: dict[str, str] | None = None) -> list[dict]:
    """The first `n` snapshots of the stream; then the client leaves."""
    events: list[dict] = []
    with httpx.stream("GET", srv.url("/v1/state/stream"), headers=headers or {}, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            assert CANARY not in line
            if line.startswith("data: "):
                events.append(_strict_json(line[len("data: "):]))
                if len(events) == n:
                    break
    return events


@pytest.mark.parametrize("engine_flag", ["--engine-process", "--no-engine-process"])
def test_state_shows_a_preemption_as_metrics_do(engine_flag: str) -> None:
    """One batch slot under the priority policy: A runs; raising B's priority preempts A. The
    state names A preempted and B running, its counts agree with /metrics, and the stream
    delivers several snapshots, one producer for all viewers, and forgets a viewer that left."""
    with start_server(engine_flag, "--policy", "priority", "--max-batch-size", "1", "--kv-cache-blocks", "512") as srv:
        idle = _state(srv)
        assert idle["requests"] == [] and idle["policy"] == "priority" and idle["viewers"] == 0
        assert set(idle["counts"]) == STATES and set(idle["latency"]) == {"window_s", "ttft", "tbt"}
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=DEADLINE_S)
        a = c.completions.create(model=MODEL, prompt=f"A {CANARY}", max_tokens=2000, stream=True,
                                 extra_body={"ignore_eos": True, "priority": 0})
        a_chunks = iter(a)
        next(a_chunks)
        b = c.completions.create(model=MODEL, prompt=f"B {CANARY}", max_tokens=1500, stream=True,
                                 extra_body={"ignore_eos": True, "priority": 5})
        a_id, b_id = a.response.headers["x-request-id"], b.response.headers["x-request-id"]
        try:
            r = httpx.post(srv.url(f"/v1/requests/{b_id}/priority"), json={"priority": -1}, timeout=DEADLINE_S)
            assert r.status_code == 200
            next(iter(b))

            def preempted() -> bool:
                states = {r["id"]: r["state"] for r in _state(srv)["requests"]}
                return states == {a_id: "preempted", b_id: "running"}

            until(preempted)
            s = _state(srv)
            m = srv.metrics()
            assert s["counts"]["preempted"] == 1 == m["tokenslice:num_requests_preempted"]
            assert s["counts"]["running"] == 1 == m["tokenslice:num_requests_running"]
            assert s["engine"]["num_preempted"] == 1 and s["engine"]["num_running"] == 1
            assert s["counters"]["preemptions"] == 1 == m["tokenslice:num_preemptions_total"]
            (ra,) = [r for r in s["requests"] if r["id"] == a_id]
            assert ra["preemptions"] == 1 and ra["output_tokens"] >= 1 and s["kv"]["owners"][a_id]["device"] >= 1
            classes = s["queues"]["classes"]
            assert [cl["priority"] for cl in classes] == [-1, 0]
            assert s["kv"]["device"]["used"] >= 2 and s["kv"]["device"]["blocks"] == 512
            assert s["latency"]["ttft"]["count"] >= 2 and s["latency"]["tbt"]["p50"] > 0

            events = _sse_events(srv, 3)
            seqs = [e["seq"] for e in events]
            assert seqs == sorted(set(seqs))  # each a new snapshot
            assert all(e["counts"]["preempted"] == 1 for e in events)
            assert events[-1]["viewers"] == 1
            until(lambda: _state(srv)["viewers"] == 0)  # the stream ended when the client left
        finally:
            b.close()
            a.close()
        wait_idle(srv)
        until(lambda: _state(srv)["requests"] == [])


def test_infinite_numbers_become_null() -> None:
    """An MLFQ's numbers may be infinite; the page's JSON.parse would refuse `Infinity`."""
    with start_server("--no-engine-process", "--policy", "skip-join-mlfq") as srv:
        assert _state(srv)["queues"]["kind"] == "mlfq"
    assert encode({"quantum_left_s": math.inf, "remaining_s": math.nan}) == b'{"quantum_left_s":null,"remaining_s":null}'


def test_viewers_share_one_producer() -> None:
    """Many concurrent readers: the engine is asked at most once per interval, whoever asks."""
    with start_server("--no-engine-process") as srv:
        hub = srv.server.state
        before = _state(srv)["seq"]
        t0 = time.monotonic()
        with httpx.Client(timeout=DEADLINE_S) as client:
            for _ in range(20):
                assert client.get(srv.url("/v1/state")).status_code == 200
        elapsed = time.monotonic() - t0
        # Snapshots taken: at most one per interval elapsed, plus the one in flight at the start.
        assert hub.seq - before <= elapsed / hub.min_interval_s + 2


def test_state_needs_the_key() -> None:
    with start_server("--api-key", "sekrit") as srv:
        assert httpx.get(srv.url("/v1/state"), timeout=DEADLINE_S).status_code == 401
        assert httpx.get(srv.url("/v1/state/stream"), timeout=DEADLINE_S).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.get(srv.url("/v1/state"), headers=bad, timeout=DEADLINE_S).status_code == 401
        assert _state(srv, "sekrit")["requests"] == []
        assert len(_sse_events(srv, 2, {"Authorization": "Bearer sekrit"})) == 2
