"""The HTTP benchmark client (`tokenslice bench`): against a real tokenslice server on 127.0.0.1,
and against an independent minimal OpenAI-compatible server written here with FastAPI, whose
tokens come no earlier than a known schedule (so the client's stamps can be checked against it)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serverkit import RunningServer, start_server, wait_idle
from tokenslice.bench.client import LoadClient
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.server_counters import counters_as_metrics, parse_counters
from tokenslice.bench.metrics import SLO, summarize
from tokenslice.bench.report import format_table, load_results
from tokenslice.bench.sweep import BenchSpec, bench_summary, clearly_past, run_bench, running_server, ServerSpec
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.priority_patterns import PriorityPattern
from tokenslice.bench.workloads import WorkloadRequest, make_workload

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

# The paced server: first token after TTFT_S, then one every TPOT_S.
TTFT_S = 0.3
TPOT_S = 0.1
SERVER_START_S = 120.0  # a failure deadline for the in-thread servers, not a performance check
# A timer may fire up to its clock's resolution early: bounds on the client's stamps allow this much.
CLOCK_SLACK_S = 1e-3


def _request(i: int, prompt: str | None, out: int, at: float = 0.0, prompt_len: int = 8, **kw: Any) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", at, prompt, prompt_len, out, **kw)


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "256", "--max-batch-size", "8") as s:
        yield s


def _check_record(rec: ClientRecord, expected_tokens: int) -> None:
    assert rec.ok, rec.error
    times = [rec.arrival, *rec.token_times, rec.finish_time]
    assert all(a <= b for a, b in zip(times, times[1:])), times  # one monotonic clock, in order
    assert rec.first_token_time == rec.token_times[0]
    # With ignore_eos the server generates exactly max_tokens; the client saw each token.
    assert rec.usage_completion_tokens == rec.output_tokens == rec.chunks == expected_tokens
    assert rec.usage_prompt_tokens is not None and rec.prompt_tokens == rec.usage_prompt_tokens


# ---------------------------------------------------------------- against tokenslice

def test_open_loop_against_tokenslice(srv: RunningServer) -> None:
    requests = make_workload("synthetic-zipf", num_requests=16, rate=40.0, seed=3, min_len=2, max_len=40)
    result = LoadClient(ClientConfig(srv.base_url + "/v1", send_expected_length=True)).run(requests)
    assert [r.request_id for r in result.records] == [r.request_id for r in requests]
    for rec, req in zip(result.records, requests):
        _check_record(rec, req.output_len)
        assert rec.scheduled_time == req.arrival_time
    # Server-side counters came from /metrics, differenced over the run.
    assert result.server_counters["tokenslice:generation_tokens_total"] == sum(r.output_len for r in requests)
    assert result.server_counters["tokenslice:request_success_total"] == len(requests)
    scraped = counters_as_metrics(result.server_counters)
    assert scraped["preemptions"] >= 0 and "swap_out_bytes" in scraped and "server_mean_queue_s" in scraped
    m = summarize(result.records)
    assert m["num_finished"] == len(requests) and m["mean_ttft"] > 0


def test_chat_and_closed_loop_against_tokenslice(srv: RunningServer) -> None:
    requests = [_request(i, f"Say {i}.", 5 + i) for i in range(6)]
    cfg = ClientConfig(srv.base_url, endpoint="chat", max_concurrency=2)
    result = LoadClient(cfg).run(requests)
    for rec, req in zip(result.records, requests):
        _check_record(rec, req.output_len)
    # Never more than two in flight: each request started after all but one earlier one ended.
    spans = sorted((r.arrival, r.finish_time) for r in result.records)
    for start, _ in spans:
        assert sum(s <= start < f for s, f in spans) <= 2


def test_errors_and_timeouts_stay_in_the_denominator(srv: RunningServer) -> None:
    too_long = "x" * (srv.info.max_model_len + 10)  # byte-level tokenizer: more tokens than the context
    requests = [_request(0, "fine", 4), _request(1, too_long, 4)]
    result = LoadClient(ClientConfig(srv.base_url)).run(requests)
    # 1,500 decode steps cannot finish in 0.3 s on any CPU this runs on (a step takes milliseconds);
    # a run of its own, so that the short timeout cannot reach the others on a busy machine.
    timed_out = LoadClient(ClientConfig(srv.base_url, request_timeout_s=0.3)).run([_request(2, "slow", 1500)])
    records = result.records + timed_out.records
    ok, bad, slow = records
    assert ok.ok and ok.output_tokens == 4, ok.error
    assert not bad.ok and bad.error.startswith("HTTP 400")
    assert not slow.ok and "timeout" in slow.error and slow.finish_time is None
    m = summarize(records, slo=SLO(mean_normalized_latency=1e9))
    assert (m["num_requests"], m["num_finished"], m["num_failed"]) == (3, 1, 2)
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    # The timed-out stream was dropped, so the server aborted it and freed its blocks.
    assert wait_idle(srv)["tokenslice:num_requests_running"] == 0
    stats = srv.server.async_engine.stats  # the engine core's KV, as it last reported it
    assert stats.device_blocks_used == 0


def test_multiturn_waits_for_each_answer(srv: RunningServer) -> None:
    first = [_request(i, f"Hello {i}.", 6, at=0.01 * i, conversation_id=f"c{i}") for i in range(3)]
    followups = {f"c{i}": [_request(10 * i + k, f"Turn {k} of {i}.", 4 + k, conversation_id=f"c{i}", turn=k)
                           for k in (1, 2)] for i in range(3)}
    result = LoadClient(ClientConfig(srv.base_url)).run(first, followups)
    assert len(result.records) == 9
    for i in range(3):
        turns = [r for r in result.records if r.conversation_id == f"c{i}"]
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, nxt in zip(turns, turns[1:]):
            assert prev.ok and nxt.ok
            assert nxt.arrival >= prev.finish_time  # sent only once the previous answer was complete
            assert nxt.prompt_tokens > prev.prompt_tokens  # it carries the history


def test_multiturn_followups_from_sharegpt() -> None:
    spec = BenchSpec(workload="sharegpt-multiturn", policies=["x"], rates=[1.0], num_requests=20, seed=0,
                     dataset=str(SHARED / "data"), tokenizer=str(SHARED / "tokenizers" / "gpt2"), max_tokens_cap=32)
    cache = DatasetCache()
    requests = spec.make(1.0, cache)
    followups = spec.followups(requests, cache)
    assert followups and set(followups) <= {r.conversation_id for r in requests}
    for cid, turns in followups.items():
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        assert all(t.prompt is not None and 1 <= t.output_len <= 32 and t.conversation_id == cid for t in turns)


def test_bench_sweep_against_a_url(srv: RunningServer) -> None:
    spec = BenchSpec(workload="synthetic-fixed", policies=["ours"], rates=[5.0, 10.0], num_requests=6,
                     input_len=8, output_len=6, slo=SLO(mean_normalized_latency=10.0), warmup_requests=1)
    results = run_bench(spec, ClientConfig(srv.base_url))
    assert results["tool"] == "bench" and [r["rate"] for r in results["runs"]] == [5.0, 10.0]
    run = results["runs"][0]
    assert run["metrics"]["num_failed"] == 0 and run["metrics"]["tokens_match_chunks"]
    assert run["metrics"]["preemptions"] is not None and "per_request" in run
    assert results["summary"]["max_rate_under_slo"] == {"ours": 10.0}
    assert results["summary"]["max_rate_censored"] == ["ours"]
    assert results["workload"]["server"]["model"] == "builtin:tiny"
    assert "ours" in format_table([results])
    closed = run_bench(dataclasses.replace(spec, rates=None, concurrency=[1, 3], warmup_requests=0),
                       ClientConfig(srv.base_url))
    assert [r["concurrency"] for r in closed["runs"]] == [1, 3] and closed["workload"]["sweep"] == "concurrency"
    assert closed["summary"]["max_concurrency_under_slo"] == {"ours": 3.0}
    assert "concurrency" in format_table([closed]).splitlines()[0]


# ---------------------------------------------------------------- sweep logic

def test_early_stop_and_summary() -> None:
    assert not clearly_past([0.5], 1.0, 2.0)
    assert clearly_past([0.5, 2.5], 1.0, 2.0)  # far past
    assert clearly_past([1.2, 1.5], 1.0, 2.0)  # past twice in a row
    assert clearly_past([0.5, None], 1.0, 2.0)  # failed requests
    spec = BenchSpec(workload="synthetic-fixed", policies=["fcfs", "mlfq"], rates=[1.0, 2.0, 3.0],
                     slo=SLO(mean_normalized_latency=1.0))
    runs = [{"policy": p, "rate": x, "metrics": {"mean_normalized_latency": v, "num_failed": 0}}
            for p, pts in (("fcfs", [(1.0, 0.5), (2.0, 1.5)]), ("mlfq", [(1.0, 0.2), (2.0, 0.6), (3.0, 1.4)]))
            for x, v in pts]
    summ = bench_summary(runs, spec, spec.slo, {"fcfs": [3.0]})
    assert summ["max_rate_under_slo"] == {"fcfs": pytest.approx(1.5), "mlfq": pytest.approx(2.5)}
    assert summ["max_rate_ratio_vs_fcfs"]["mlfq"] == pytest.approx(2.5 / 1.5)
    assert summ["early_stopped"] == {"fcfs": [3.0]}


def test_parse_counters() -> None:
    text = "\n".join([
        "# TYPE ts:num_preemptions_total counter", 'ts:num_preemptions_total{m="a"} 3.0',
        'ts:num_preemptions_created{m="a"} 1.7e9',
        "# TYPE ts:req counter", 'ts:req_total{m="a",r="stop"} 2.0', 'ts:req_total{m="a",r="length"} 5.0',
        "# TYPE ts:lat histogram", 'ts:lat_bucket{le="1.0"} 4.0', "ts:lat_sum 2.5", "ts:lat_count 4.0",
        "# TYPE ts:running gauge", "ts:running 7.0", "# TYPE other_total counter", "other_total 9.0"])
    got = parse_counters(text, "ts:")
    assert got["ts:num_preemptions_total"] == 3.0 and got["ts:req_total"] == 7.0
    assert got["ts:lat_sum"] == 2.5 and got["ts:lat_count"] == 4.0
    assert not any(k.startswith(("ts:running", "other", "ts:lat_bucket")) or "created" in k for k in got)
    assert counters_as_metrics(got, "ts:")["preemptions"] == 3.0


def test_bench_command_starts_and_stops_servers(tmp_path: Path) -> None:
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, "-m", "tokenslice.cli", "bench", "--model", "builtin:tiny", "--policy", "fcfs,srpt-oracle",
           "--workload", "synthetic-zipf", "--min-len", "2", "--max-len", "16", "--rates", "20",
           "--num-requests", "8", "--slo-normalized-latency", "1", "--warmup", "1", "--quiet", "--interleave",
           "--server-args=--no-compile",
           "--out", str(out), "--plot", str(fig)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = load_results([out])[0]
    assert [r["policy"] for r in results["runs"]] == ["fcfs", "srpt-oracle"]
    assert all(r["metrics"]["num_failed"] == 0 for r in results["runs"])
    assert results["workload"]["client"]["send_expected_length"] is True
    assert fig.stat().st_size > 0 and "max rate under SLO" in done.stdout
    report = subprocess.run([sys.executable, "-m", "tokenslice.cli", "report", str(out), str(out),
                             "--plot", str(tmp_path / "merged.png")], cwd=ROOT, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tmp_path / "merged.png").stat().st_size > 0


def test_running_server_is_torn_down() -> None:
    with running_server(ServerSpec("builtin:tiny", args=["--kv-cache-blocks", "16", "--no-compile"]), "fcfs") as url:
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


# ---------------------------------------------------------------- an independent server at a known pace

def app_serving(model: str) -> FastAPI:
    """A FastAPI app whose /v1/models lists `model`; tests add the routes they need."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    return app


def paced_app(received: list[dict[str, Any]]) -> FastAPI:
    """A minimal OpenAI-compatible completions server: TTFT_S to the first token, then TPOT_S per
    token. Prompt "stall" never finishes; prompt "fail" sends an error event mid-stream. Its answer
    text names the request, so a conversation's next prompt shows whether it carried the answer."""
    app = app_serving("paced")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        received.append({**body, "t": time.perf_counter()})
        n = body["max_tokens"]

        async def events() -> AsyncIterator[str]:
            start = time.perf_counter()
            for i in range(n):
                # Sleep to an absolute schedule, so that delays do not accumulate.
                await asyncio.sleep(max(0.0, start + TTFT_S + i * TPOT_S - time.perf_counter()))
                if body["prompt"] == "stall":
                    await asyncio.sleep(3600)
                if body["prompt"] == "fail" and i == 2:
                    yield "data: " + json.dumps({"error": {"message": "boom", "type": "server_error"}}) + "\n\n"
                    return
                text = f" answer{len(received)}.{i}"
                chunk = {"id": "x", "object": "text_completion", "model": "paced",
                         "choices": [{"index": 0, "text": text, "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield "data: " + json.dumps({"id": "x", "object": "text_completion", "choices": [], "usage": usage})
            yield "\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """`app` on uvicorn on a free loopback port, in a thread; its base URL. Stopped on exit."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def paced() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    with serve_in_thread(paced_app(received)) as url:
        yield url, received


def test_client_sends_on_schedule_and_stamps_every_token(paced: tuple[str, list[dict[str, Any]]]) -> None:
    url, received = paced
    requests = [_request(i, f"p{i}", 8, at=0.05 * i) for i in range(4)]
    before = len(received)
    result = LoadClient(ClientConfig(url)).run(requests)
    assert [r.request_id for r in result.records] == [r.request_id for r in requests]
    for rec, req in zip(result.records, requests):
        assert rec.ok and rec.output_tokens == rec.chunks == 8
        assert rec.scheduled_time == req.arrival_time
        # Never sent before its arrival time (late is allowed: a busy machine sends late).
        assert rec.arrival >= rec.scheduled_time - CLOCK_SLACK_S
        times = [rec.arrival, *rec.token_times, rec.finish_time]
        assert all(a <= b for a, b in zip(times, times[1:])), times
        # The server holds each token to its schedule, so no stamp comes before it: lower bounds only.
        assert rec.ttft >= TTFT_S - CLOCK_SLACK_S
        assert rec.e2e >= TTFT_S + 7 * TPOT_S - CLOCK_SLACK_S
    sent = [r.arrival for r in result.records]
    assert sent == sorted(sent)  # sent in the order of the workload
    bodies = received[before:]
    assert sorted(b["prompt"] for b in bodies) == [f"p{i}" for i in range(4)]
    assert all(b["max_tokens"] == 8 and b["stream"] and b["ignore_eos"] for b in bodies)
    assert result.server_counters == {}  # no /metrics there: nothing scraped, nothing invented
    assert summarize(result.records)["num_finished"] == 4
    # The decode step is measured from lone requests of synthetic ids, one after another.
    before = len(received)
    step = LoadClient(ClientConfig(url)).measure_decode_step(output_tokens=4, prompt_tokens=16, repeats=2)
    assert 0 < step < float("inf")
    calibration = received[before:]
    assert len(calibration) == 2 and calibration[1]["t"] >= calibration[0]["t"]
    assert all(b["max_tokens"] == 4 and len(b["prompt"]) == 16 and all(isinstance(t, int) for t in b["prompt"])
               for b in calibration)


def test_independent_server_failures_and_history(paced: tuple[str, list[dict[str, Any]]]) -> None:
    url, received = paced
    requests = [_request(1, "fail", 4), _request(2, "hi", 3, conversation_id="c"),
                _request(3, "fail", 4, conversation_id="d")]
    followups = {"c": [_request(20, "again", 2, conversation_id="c", turn=1)],
                 "d": [_request(30, "never sent", 2, conversation_id="d", turn=1)]}
    result = LoadClient(ClientConfig(url)).run(requests, followups)
    # The stall never ends, so any timeout fires; a run of its own keeps the others clear of it.
    stalled = LoadClient(ClientConfig(url, request_timeout_s=TTFT_S + 1.0)).run([_request(0, "stall", 4)])
    records = stalled.records + result.records
    by_id = {r.request_id: r for r in records}
    assert "timeout" in by_id["r0"].error and "boom" in by_id["r1"].error
    assert not by_id["r30-turn1"].ok and "earlier turn" in by_id["r30-turn1"].error
    first, second = by_id["r2"], by_id["r20-turn1"]
    assert first.ok and second.ok and second.arrival >= first.finish_time
    sent = next(b for b in received if isinstance(b["prompt"], str) and b["prompt"].endswith("again"))
    assert sent["prompt"].startswith("hi") and first.text in sent["prompt"]
    m = summarize(records)
    assert (m["num_requests"], m["num_failed"]) == (6, 4)


# ---------------------------------------------------------------- priority updates (FastSwitch §4)

def priority_app(bodies: list[dict[str, Any]], calls: list[tuple[str, int, int]], tpot_s: float = TPOT_S / 2
                 ) -> FastAPI:
    """Completions at `tpot_s` per token, each named cmpl-N in X-Request-Id and every chunk, and
    the priority route: 200 for a live request, 404 otherwise. Prompt "gone" is never live (its
    updates all get 404). `calls` gets (id, priority, status) of every update."""
    app = app_serving("prio")
    live: set[str] = set()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        bodies.append(body)
        rid = f"cmpl-{len(bodies)}"
        if body["prompt"] != "gone":
            live.add(rid)

        async def events() -> AsyncIterator[str]:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(tpot_s)
                last = i == body["max_tokens"] - 1
                if last:
                    live.discard(rid)
                chunk = {"id": rid, "object": "text_completion", "model": "prio",
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": rid})

    @app.post("/v1/requests/{rid}/priority")
    async def set_priority(rid: str, request: Request) -> JSONResponse:
        level = int((await request.json())["priority"])
        status = 200 if rid in live else 404
        calls.append((rid, level, status))
        if status == 404:
            return JSONResponse({"error": {"message": "not live", "type": "not_found"}}, status_code=404)
        return JSONResponse({"id": rid, "priority": level})

    return app


def test_client_sends_initial_priorities_and_updates_live_requests() -> None:
    bodies: list[dict[str, Any]] = []
    calls: list[tuple[str, int, int]] = []
    requests = [_request(0, "a", 20), _request(1, "b", 20, at=0.1), _request(2, "gone", 20, at=0.2),
                _request(3, "late", 4, at=0.3)]
    pattern = PriorityPattern("markov", update_freq=0.5, levels=4, seed=1)  # every 2 iterations
    with serve_in_thread(priority_app(bodies, calls)) as url:
        client = LoadClient(ClientConfig(url))
        with pytest.raises(ValueError, match="iteration time"):
            client.run(requests, priority=pattern)
        result = client.run(requests, priority=pattern, iteration_s=TPOT_S)
    by_id = {r.request_id: r for r in result.records}
    assert all(r.ok for r in result.records)
    # Initial levels go in the body and stay on the records; the client learnt each response id.
    by_response = {r.response_id: r for r in result.records}
    for i, body in enumerate(bodies):
        rec = by_response[f"cmpl-{i + 1}"]
        assert body["priority"] == rec.priority and 0 <= rec.priority < 4
        # Markov: each update moves a request's level by at most one.
        levels = [rec.priority] + [level for rid, level, _ in calls if rid == rec.response_id]
        assert all(abs(a - b) <= 1 for a, b in zip(levels, levels[1:]))
    # Updates: only for ids the server issued, levels in range; 404 (finished, or never live) is not an error.
    issued = {r.response_id for r in result.records}
    assert calls and {rid for rid, _, _ in calls} <= issued
    assert all(0 <= level < 4 for _, level, _ in calls)
    counts = result.priority_updates
    assert counts["accepted"] == sum(status == 200 for *_, status in calls) > 0
    assert counts["not_live"] == sum(status == 404 for *_, status in calls) > 0
    assert counts["failed"] == 0 and counts["points"] > 0
    assert all(status == 404 for rid, _, status in calls if rid == by_id["r2"].response_id)


def test_bench_command_with_priority_pattern_and_users(tmp_path: Path) -> None:
    from tokenslice.cli import main

    bodies: list[dict[str, Any]] = []
    calls: list[tuple[str, int, int]] = []
    out = tmp_path / "prio.json"
    with serve_in_thread(priority_app(bodies, calls, tpot_s=0.01)) as url:
        rc = main(["bench", "--url", url, "--workload", "synthetic-fixed", "--rates", "20", "--num-requests", "6",
                   "--input-len", "8", "--output-len", "12", "--num-users", "2", "--priority-pattern", "random",
                   "--priority-update-freq", "0.5", "--priority-levels", "3", "--warmup", "1",
                   "--slo-normalized-latency", "10", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    wl = data["workload"]
    assert (wl["priority_pattern"], wl["priority_update_freq"], wl["priority_levels"], wl["num_users"]) == \
        ("random", 0.5, 3, 2)
    # No --iteration-s: a lone request's decode step was measured (how long it is depends on the machine).
    assert 0 < wl["iteration_s"] < float("inf")
    run = data["runs"][0]
    assert sorted(run["per_user"]) == ["user-0", "user-1"]
    assert run["metrics"]["num_users"] == 2 and run["metrics"]["jain_service"] is not None
    assert run["priority_updates"]["accepted"] > 0 and run["priority_updates"]["failed"] == 0
    measured = [b for b in bodies if "priority" in b]
    assert len(measured) == 6 and all(0 <= b["priority"] < 3 for b in measured)  # warm-up and calibration send none
