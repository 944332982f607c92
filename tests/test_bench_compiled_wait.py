"""`tokenslice bench` loads a server only once /v1/state says its compiled decode is built (ready,
off or failed), never longer than its timeout, and not at all with --no-wait-compiled; servers
that do not report it are not waited for. Against scripted servers on 127.0.0.1 (what /v1/state
says, and when the first request came) and a real `tokenslice serve` that bench starts."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from test_bench_client import app_serving, paced_app, serve_in_thread
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.compile_wait import wait_compiled
from tokenslice.bench.metrics import SLO
from tokenslice.bench.sweep import BenchSpec, ServerSpec, run_bench
from tokenslice.cli import build_parser

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def _status(state: str, ready: int = 1) -> dict[str, Any]:
    return {"state": state, "buckets_ready": ready, "buckets": 2, "seconds": None, "steps": 0, "error": None}


def add_state(app: FastAPI, answers: list[dict[str, Any] | None], calls: list[float]) -> FastAPI:
    """/v1/state answering `answers` in turn (the last one from then on); None: no compiled_decode.
    Each call's time goes to `calls`."""
    @app.get("/v1/state")
    async def state() -> JSONResponse:
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(time.perf_counter())
        return JSONResponse({"running": [], **({"compiled_decode": answer} if answer is not None else {})})

    return app


@contextmanager
def state_server(answers: list[dict[str, Any] | None]) -> Iterator[tuple[ClientConfig, list[float]]]:
    calls: list[float] = []
    with serve_in_thread(add_state(app_serving("scripted"), answers, calls)) as url:
        yield ClientConfig(url), calls


def test_waits_while_pending_then_says_what_it_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    with state_server([_status("pending")] * 3 + [_status("ready", 2)]) as (cfg, calls), \
            caplog.at_level(logging.INFO, logger="tokenslice.bench.compile_wait"):
        waited = wait_compiled(cfg, timeout_s=60)
    assert (waited.state, len(calls)) == ("ready", 4) and waited.detail == _status("ready", 2)
    text = caplog.text
    assert "waiting for" in text and "(1 of 2 graphs built)" in text
    assert "compiled decode ready after waiting" in text and "(2 of 2 graphs built)" in text


def test_off_failed_and_silent_servers_are_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    for answer, state in ((_status("off", 0), "off"), (_status("failed"), "failed"), (None, "not reported")):
        with state_server([answer]) as (cfg, calls):
            assert wait_compiled(cfg, timeout_s=60).state == state and len(calls) == 1
    assert "compiled decode failed" in caplog.text
    with serve_in_thread(app_serving("no-state")) as url:  # not a tokenslice server: no /v1/state
        assert wait_compiled(ClientConfig(url), timeout_s=60).state == "no state"


def test_a_build_past_the_timeout_is_an_error_naming_the_flags() -> None:
    with state_server([_status("pending")]) as (cfg, calls):
        with pytest.raises(ValueError) as e:
            wait_compiled(cfg, timeout_s=1.0)
    msg = str(e.value)
    assert msg.startswith(f"{cfg.root}: compiled decode still being built after 1 s (1 of 2 graphs built)")
    assert "--wait-compiled-timeout-s" in msg and "--no-wait-compiled" in msg and len(calls) >= 2


def test_bench_against_a_url_sends_nothing_before_compiled_decode_is_ready() -> None:
    received: list[dict[str, Any]] = []
    calls: list[float] = []
    app = add_state(paced_app(received), [_status("pending")] * 3 + [_status("ready", 2)], calls)
    spec = BenchSpec(workload="synthetic-fixed", policies=["server"], rates=[50.0], num_requests=2, input_len=4,
                     output_len=2, slo=SLO(mean_normalized_latency=10.0), warmup_requests=1)
    with serve_in_thread(app) as url:
        results = run_bench(spec, ClientConfig(url))
        assert len(calls) == 4 and received and min(r["t"] for r in received) > calls[-1]
        assert results["workload"]["server"]["compiled_decode"]["server"]["state"] == "ready"
        # --no-wait-compiled: straight to the load.
        before = len(calls)
        skipped = run_bench(dataclasses.replace(spec, wait_compiled=False), ClientConfig(url))
        assert len(calls) == before and skipped["workload"]["server"]["compiled_decode"] == {}


def test_flags() -> None:
    parse = build_parser().parse_args
    base = ["bench", "--url", "http://127.0.0.1:1", "--workload", "synthetic-fixed", "--rates", "1"]
    a = parse(base)
    assert (a.wait_compiled, a.wait_compiled_timeout_s) == (True, BenchSpec.wait_compiled_timeout_s)
    a = parse(base + ["--no-wait-compiled", "--wait-compiled-timeout-s", "30"])
    assert (a.wait_compiled, a.wait_compiled_timeout_s) == (False, 30.0)


def test_bench_waits_for_the_server_it_starts_to_build_compiled_decode() -> None:
    """A real `tokenslice serve` (compiled decode built in the background, the default on CPU):
    the sweep begins once it is built; the server is stopped and reaped after it."""
    spec = BenchSpec(workload="synthetic-fixed", policies=["fcfs"], rates=[20.0], num_requests=3, input_len=8,
                     output_len=8, slo=SLO(mean_normalized_latency=10.0), warmup_requests=1,
                     wait_compiled_timeout_s=600.0)  # a failure deadline (cold compiles on 2 busy cores)
    server = ServerSpec(str(STORIES), args=["--kv-cache-blocks", "64", "--max-batch-size", "4"])
    results = run_bench(spec, ClientConfig(""), server)
    waited = results["workload"]["server"]["compiled_decode"]["fcfs"]
    assert waited["state"] == "ready", waited
    assert results["runs"][0]["metrics"]["num_failed"] == 0
