"""The engine core in its own process (engine/core.py) behind the API server: aborts, stop
strings and priority updates cross the process boundary, /metrics shows the core's counters,
and the core's death is seen at once (error events, /health 503, a non-zero exit)."""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server, wait_idle

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"
MODEL = "builtin:tiny"
DEADLINE_S = 60.0  # failure deadlines, not performance checks


def _until(cond: object, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _client(srv: RunningServer, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key=key, max_retries=0, timeout=DEADLINE_S)


def _metric(srv: RunningServer, name: str) -> float:
    return srv.metrics().get(name, 0.0)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "64", "--max-model-len", "512") as s:
        assert s.core_pid != os.getpid()
        yield s


def test_abort_frees_kv_in_the_core(srv: RunningServer) -> None:
    stream = _client(srv).completions.create(model=MODEL, prompt="abort me", max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()  # the client leaves mid-stream
    m = wait_idle(srv)
    assert m["tokenslice:kv_cache_usage_perc"] == 0
    assert m['tokenslice:request_success_total{finished_reason="abort",model_name="builtin:tiny"}'] >= 1
    assert m.get('tokenslice:request_success_total{finished_reason="length",model_name="builtin:tiny"}', 0) == 0


def test_engine_refusals_are_400_across_the_boundary(srv: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _client(srv).completions.create(model=MODEL, prompt=[5] * 600, max_tokens=4)  # longer than the context
    assert exc.value.body["param"] == "prompt" and "context" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:  # fcfs refuses priorities
        _client(srv).completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"priority": 3})
    assert exc.value.body["param"] == "priority"


def test_engine_side_counters_reach_metrics(srv: RunningServer) -> None:
    before = srv.metrics()
    r = _client(srv).completions.create(model=MODEL, prompt="count my prompt tokens", max_tokens=5,
                                        extra_body={"ignore_eos": True})
    m = wait_idle(srv)
    assert m["tokenslice:kv_cache_num_blocks"] == 64
    # Counted by the scheduler in the core, shipped with its step outputs.
    assert m["tokenslice:prefix_cache_queries_total"] - before.get("tokenslice:prefix_cache_queries_total", 0) \
        == r.usage.prompt_tokens
    assert m["tokenslice:generation_tokens_total"] - before["tokenslice:generation_tokens_total"] == 5
    assert m["tokenslice:time_to_first_token_seconds_count"] > before["tokenslice:time_to_first_token_seconds_count"]
    assert m["tokenslice:inter_token_latency_seconds_count"] - before["tokenslice:inter_token_latency_seconds_count"] == 4


@pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260k")
def test_stop_string_ends_the_stream_and_frees_kv() -> None:
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "32") as srv:
        c = _client(srv)
        full = c.completions.create(model=str(STORIES), prompt="Once upon a time", max_tokens=40, temperature=0)
        assert "girl" in full.choices[0].text  # ", there was a little girl named Lily. ..."
        cut = full.choices[0].text.index("girl")
        chunks = list(c.completions.create(model=str(STORIES), prompt="Once upon a time", max_tokens=40,
                                           temperature=0, stop=["girl"], stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text[:cut]
        assert chunks[-1].choices[0].finish_reason == "stop"
        m = wait_idle(srv)
        assert m["tokenslice:kv_cache_usage_perc"] == 0
        reasons = {k: v for k, v in m.items() if k.startswith("tokenslice:request_success_total{")}
        assert reasons == {'tokenslice:request_success_total{finished_reason="length",model_name="%s"}' % STORIES: 1,
                           'tokenslice:request_success_total{finished_reason="stop",model_name="%s"}' % STORIES: 1}


def test_priority_update_preempts_across_the_boundary() -> None:
    """One batch slot: A runs, B waits with a worse priority; raising B's priority over HTTP makes
    the core preempt A at its next step, which /metrics reports."""
    with start_server("--policy", "priority", "--max-batch-size", "1", "--kv-cache-blocks", "512") as srv:
        c = _client(srv)
        a = c.completions.create(model=MODEL, prompt="A", max_tokens=2000, stream=True,
                                 extra_body={"ignore_eos": True, "priority": 0})
        a_chunks = iter(a)
        next(a_chunks)
        b = c.completions.create(model=MODEL, prompt="B", max_tokens=1500, stream=True,
                                 extra_body={"ignore_eos": True, "priority": 5})
        b_id = b.response.headers["x-request-id"]
        try:
            assert _metric(srv, "tokenslice:num_preemptions_total") == 0
            r = httpx.post(srv.url(f"/v1/requests/{b_id}/priority"), json={"priority": -1}, timeout=30)
            assert r.status_code == 200 and r.json() == {"id": b_id, "priority": -1}
            assert next(iter(b)).id == b_id  # B got the slot
            _until(lambda: _metric(srv, "tokenslice:num_requests_preempted") == 1)
            assert _metric(srv, "tokenslice:num_preemptions_total") == 1
        finally:
            b.close()
            a.close()
        r = httpx.post(srv.url(f"/v1/requests/{b_id}/priority"), json={"priority": 1}, timeout=30)
        assert r.status_code == 404  # aborted: no longer live in the core
        assert wait_idle(srv)["tokenslice:kv_cache_usage_perc"] == 0


def test_killed_core_fails_streams_and_health() -> None:
    with start_server("--kv-cache-blocks", "64") as srv:
        c = _client(srv)
        stream = c.completions.create(model=MODEL, prompt="in flight", max_tokens=1000, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(srv.core_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as exc:  # an error event, then the stream ends
            for _ in chunks:
                pass
        assert "request id cmpl-" in str(exc.value)
        assert httpx.get(srv.url("/health")).status_code == 503
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model=MODEL, prompt="anyone?", max_tokens=4)
        assert err.value.status_code == 503 and err.value.response.headers.get("Retry-After")
        r = httpx.post(srv.url("/v1/requests/cmpl-x/priority"), json={"priority": 0}, timeout=30)
        assert r.status_code == 503


def _serve(*flags: str, new_session: bool = False) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", "--model", MODEL, "--no-compile", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _wait_for_line(lines: queue.Queue[str], pattern: str, seen: list[str]) -> re.Match[str]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_serve_exits_nonzero_when_the_core_dies(free_port: int) -> None:
    proc, lines = _serve("--port", str(free_port), "--kv-cache-blocks", "32")
    seen: list[str] = []
    try:
        pid = int(_wait_for_line(lines, r"engine core running in process (\d+)", seen).group(1))
        _wait_for_line(lines, r"Uvicorn running on http://127\.0\.0\.1:%d" % free_port, seen)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="x", max_retries=0, timeout=DEADLINE_S)
        chunks = iter(c.completions.create(model=MODEL, prompt="in flight", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True}))
        next(chunks)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        assert proc.wait(DEADLINE_S) == 1
    finally:
        _reap(proc)
    while not lines.empty():
        seen.append(lines.get())
    assert any("the engine died" in line for line in seen), "".join(seen[-20:])


def test_sigterm_to_the_process_group_is_a_clean_stop(free_port: int) -> None:
    """`timeout`, systemd and Ctrl-C signal the whole group: the core must not die first and be
    taken for a crash; the server stops cleanly and the core goes with it. (uvicorn re-raises
    the signal once shut down, so the exit status says SIGTERM, not the engine death's 1.)"""
    proc, lines = _serve("--port", str(free_port), new_session=True)
    seen: list[str] = []
    try:
        pid = int(_wait_for_line(lines, r"engine core running in process (\d+)", seen).group(1))
        _wait_for_line(lines, r"Uvicorn running on http://127\.0\.0\.1:%d" % free_port, seen)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(DEADLINE_S) in (0, -signal.SIGTERM)
    finally:
        _reap(proc)
    while not lines.empty():
        seen.append(lines.get())
    assert not any("engine" in line and ("died" in line or "exited" in line) for line in seen), "".join(seen[-20:])
    deadline = time.monotonic() + DEADLINE_S
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_serve_startup_error_is_clear_and_nonzero(free_port: int, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenslice.cli", "serve", "--model", str(tmp_path / "missing"),
                           "--port", str(free_port)], cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S * 2)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr.split("error:")[-1]
