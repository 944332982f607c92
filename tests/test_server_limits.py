"""Clients that ask too much or too slowly: many prompts in one request (refused before any is
tokenized or admitted), a client that leaves while its prompts are being submitted (the rest are
never submitted, the submitted ones aborted), half-sent headers and bodies (closed after
--request-read-timeout-s), too many connections from one address, and client values in log lines
(bounded). Real servers on 127.0.0.1; every wait is a failure deadline, not a performance check."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from pathlib import Path

import httpx
import pytest

from serverkit import RunningServer, start_server, until, wait_idle
from tokenslice.request import EngineRequest
from tokenslice.server.track import LOG_TEXT_CHARS, log_text

MODEL = "builtin:tiny"
DEADLINE_S = 60.0


def raw_request(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after DEADLINE_S)."""
    sock.settimeout(DEADLINE_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def connect(srv: RunningServer) -> socket.socket:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def count_submissions(srv: RunningServer) -> list[str]:
    """The ids of the engine requests the server submits from now on (its engine client's add_request, counted)."""
    submitted: list[str] = []
    inner = srv.server.async_engine.add_request

    async def counting(request: EngineRequest) -> object:
        submitted.append(request.request_id)
        return await inner(request)

    srv.server.async_engine.add_request = counting
    return submitted


def test_too_many_prompts_are_refused_before_admission() -> None:
    with start_server("--kv-cache-blocks", "32", "--max-waiting", "64") as srv:
        submitted = count_submissions(srv)
        r = httpx.post(srv.url("/v1/completions"), timeout=DEADLINE_S,
                       json={"model": MODEL, "prompt": ["Once"] * 3000, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "3000 prompts" in r.json()["error"]["message"] and "256" in r.json()["error"]["message"]
        # Within the prompt bound but past --max-waiting, prompts x n: never fits, so 400 too.
        r = httpx.post(srv.url("/v1/completions"), timeout=DEADLINE_S,
                       json={"model": MODEL, "prompt": ["Once"] * 40, "n": 2, "max_tokens": 8})
        assert r.status_code == 400 and "80 engine requests" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url("/v1/chat/completions"), timeout=DEADLINE_S,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert submitted == []
        r = httpx.post(srv.url("/v1/completions"), timeout=DEADLINE_S,
                       json={"model": MODEL, "prompt": ["Once"] * 32, "n": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 64 and len(submitted) == 64


def test_tenant_limits_count_every_prompt_before_admission(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[tenants.small]\nkeys = ["k-small"]\nmax_in_flight = 4\n')
    with start_server("--kv-cache-blocks", "32", "--api-keys", str(keys)) as srv:
        submitted = count_submissions(srv)
        r = httpx.post(srv.url("/v1/completions"), headers={"Authorization": "Bearer k-small"}, timeout=DEADLINE_S,
                       json={"model": MODEL, "prompt": ["Once"] * 5, "max_tokens": 2})
        assert r.status_code == 429 and "too many requests in flight" in r.json()["error"]["message"], r.text
        assert submitted == []


def test_a_client_that_leaves_during_submission_gets_no_more_prompts_submitted() -> None:
    """The 11th submission is held until the client has gone and the server has seen its
    connection close; then no further prompt of the 1,000 is submitted, and the engine ends
    with no request of it."""
    with start_server("--kv-cache-blocks", "64", "--max-prompts-per-request", "1000", "--max-waiting", "2000",
                      "--max-batch-size", "4") as srv:
        engine = srv.server.async_engine
        connections = srv.uvicorn_server.server_state.connections
        inner = engine.add_request
        submitted: list[str] = []
        client_closed = threading.Event()

        async def held(request: EngineRequest) -> object:
            submitted.append(request.request_id)
            if len(submitted) == 11:
                while not client_closed.is_set() or connections:  # the server saw the connection end
                    await asyncio.sleep(0.01)
                for _ in range(20):  # the handler's watch wakes up on the disconnect it was told of
                    await asyncio.sleep(0)
            return await inner(request)

        engine.add_request = held
        body = json.dumps({"model": MODEL, "prompt": ["Once upon a time"] * 1000, "max_tokens": 32,
                           "ignore_eos": True}).encode()
        sock = connect(srv)
        sock.sendall(raw_request("/v1/completions", body))
        until(lambda: len(submitted) >= 11, timeout=DEADLINE_S)
        sock.close()
        client_closed.set()
        wait_idle(srv, timeout=DEADLINE_S)
        assert len(submitted) == 11, len(submitted)
        m = wait_idle(srv, timeout=DEADLINE_S)
        assert m["tokenslice:num_requests_running"] == 0 and m["tokenslice:num_requests_waiting"] == 0
        assert engine.num_queued == 0


@pytest.fixture(scope="module")
def slow_srv() -> RunningServer:
    with start_server("--kv-cache-blocks", "16", "--request-read-timeout-s", "1") as s:
        yield s


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1"])
def test_half_sent_headers_are_closed_after_the_read_timeout(slow_srv: RunningServer, sent: bytes) -> None:
    sock = connect(slow_srv)
    try:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""  # closed by the server, nothing answered
    finally:
        sock.close()
    assert httpx.get(slow_srv.url("/health"), timeout=DEADLINE_S).status_code == 200


def test_the_next_request_on_a_kept_connection_gets_its_own_deadline(slow_srv: RunningServer) -> None:
    sock = connect(slow_srv)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole first answer
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest
        assert read_until_closed(sock) == b""
    finally:
        sock.close()


def test_a_half_sent_body_is_408_and_closed(slow_srv: RunningServer) -> None:
    sock = connect(slow_srv)
    try:
        whole = raw_request("/v1/completions", b'{"prompt": "Once upon a time", "max_tokens": 2}')
        sock.sendall(whole[:-10])
        answer = read_until_closed(sock)
    finally:
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_connections_past_the_per_client_bound_get_503() -> None:
    limit = 3
    with start_server("--kv-cache-blocks", "16", "--max-connections-per-client", str(limit),
                      "--request-read-timeout-s", "600") as srv:
        socks = [connect(srv) for _ in range(limit + 2)]
        try:
            for s in socks:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers not finished: the connection stays
            refused: list[bytes] = []
            for s in socks:  # the refused ones are answered and closed; the others wait for their headers
                s.setblocking(False)

            def poll() -> bool:
                for s in socks:
                    try:
                        data = s.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data:
                        refused.append(data)
                return len(refused) >= 2

            until(poll, timeout=DEADLINE_S)
            assert len(refused) == 2 and all(d.startswith(b"HTTP/1.1 503") for d in refused), refused
            assert all(b"too_many_connections" in d for d in refused)
            answered = 0
            for s in socks:
                s.setblocking(True)
                s.settimeout(DEADLINE_S)
                try:
                    s.sendall(b"\r\n")
                    answered += s.recv(65536).startswith(b"HTTP/1.1 200")  # the status line comes first
                except OSError:
                    pass  # a refused one, closed
            assert answered == limit
        finally:
            for s in socks:
                s.close()
        until(lambda: httpx.get(srv.url("/health"), timeout=DEADLINE_S).status_code == 200, timeout=DEADLINE_S)


def test_client_values_in_log_lines_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    long_id = "x" * 10_000
    assert len(log_text(long_id)) < LOG_TEXT_CHARS + 60 and "10000 chars, sha256" in log_text(long_id)
    assert log_text(long_id) != log_text(long_id[:-1] + "y")  # told apart by the hash
    assert "\n" not in log_text("a\nforged line") and log_text("plain") == "plain"
    with start_server("--kv-cache-blocks", "16") as srv, caplog.at_level(logging.INFO, logger="tokenslice.server"):
        r = httpx.post(srv.url(f"/v1/requests/{long_id}%0Aforged/priority"), json={"priority": 0},
                       timeout=DEADLINE_S)
        assert r.status_code == 404
        r = httpx.post(srv.url("/tokenize"), json={"prompt": 5, long_id: 1}, timeout=DEADLINE_S)
        assert r.status_code == 400
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines and all(len(line) < 1000 and "\n" not in line for line in lines), [len(x) for x in lines]
