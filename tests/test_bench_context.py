"""`tokenslice bench` fits its workloads to the served context (read from /v1/models) and says how
many requests it capped, groups failure reasons under the table, answers an unreachable --url in
one line, starts its servers on a given port, and names the served model by its directory."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.metrics import SLO
from tokenslice.bench.run_notes import format_notes, reason_key
from serverkit import start_server
from tokenslice.bench.servers import ServerSpec, serve_command, served_name
from tokenslice.bench.sweep import BenchSpec, run_bench
from tokenslice.bench.workloads import TEXT_SLACK_TOKENS, WorkloadRequest, fit_context
from tokenslice.cli import build_parser, main
from tokenslice.cli.serve_options import server_settings

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fit_context_caps_prompt_and_output_to_the_context() -> None:
    reqs = [WorkloadRequest("fits", 0.0, None, 100, 100), WorkloadRequest("long-out", 0.0, None, 400, 300),
            WorkloadRequest("long-prompt", 0.0, None, 600, 50), WorkloadRequest("both", 0.0, None, 2000, 2000),
            WorkloadRequest("text", 0.0, "some text", 490, 10, prompt_token_ids=list(range(490)))]
    out, capped = fit_context(reqs, 512, ClientConfig("http://unused"))
    assert capped == 4 and out[0] == reqs[0]
    assert [(r.prompt_len, r.output_len) for r in out[1:4]] == [(400, 112), (462, 50), (256, 256)]
    # A text prompt keeps room for the server's own tokens, and is sent as its ids once cut.
    limit = 512 - TEXT_SLACK_TOKENS
    text = out[4]
    assert text.prompt_len + text.output_len == limit and text.output_len == 10
    assert text.prompt is None and text.prompt_token_ids == list(range(text.prompt_len))
    assert all(r.prompt_len + r.output_len <= 512 for r in out)
    assert fit_context(reqs, None) == (reqs, 0)  # a server that does not say: as they are


def test_notes_group_failures_by_reason_and_count_capped_requests() -> None:
    runs = [{"policy": "fcfs", "rate": 2.0, "num_requests": 10,
             "capped_to_context": {"max_model_len": 512, "requests": 3},
             "per_request": {"error_counts": {"HTTP 400: context is 512 tokens, but 600 were requested": 2,
                                              "HTTP 400: context is 512 tokens, but 610 were requested": 1,
                                              "timeout after 600 s": 1}}},
            {"policy": "fcfs", "rate": 4.0, "num_requests": 10,
             "capped_to_context": {"max_model_len": 512, "requests": 3}, "per_request": {"error_counts": {}}}]
    notes = format_notes([{"runs": runs}]).splitlines()
    assert notes[0] == "  3 of 10 requests capped to fit the served max_model_len 512 (prompt + output)"
    assert notes[1:] == ["failed requests by reason:", "  fcfs rate 2: 4 failed",
                         "    3 x HTTP N: context is N tokens, but N were requested", "    1 x timeout after N s"]
    ids = {reason_key(f"error event: internal engine error (request id chatcmpl-{h})") for h in ("9fa3c0", "1be")}
    assert ids == {"error event: internal engine error (request id <id>)"}
    assert reason_key("x" * 500).endswith("…") and format_notes([{"runs": runs[1:2]}]).count("\n") == 0


def test_unreachable_url_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    rc = main(["bench", "--url", url, "--workload", "synthetic-zipf", "--rates", "2", "--num-requests", "3",
               "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"error: cannot reach {url}") and "\n" not in err, err


def test_bench_servers_take_the_port_and_the_directory_name() -> None:
    spec = ServerSpec(model=str(STORIES), args=["--no-compile"], port=9100)
    cmd = serve_command(spec, "fcfs", 9101)
    a = build_parser().parse_args(cmd[cmd.index("-m") + 2:])
    assert (a.port, a.model, a.policy, a.compile) == (9101, str(STORIES), "fcfs", False)
    # The directory's name first (what clients see), the path still accepted.
    assert server_settings(a).model_names == ("stories260k", str(STORIES))
    assert served_name("builtin:tiny") == "builtin:tiny"
    assert "--served-model-name" not in serve_command(ServerSpec(model="builtin:tiny"), "fcfs", 9100)


def test_bench_fits_the_served_context() -> None:
    """synthetic-zipf's default lengths reach 2048 tokens, past the served context of 64: such
    requests are capped to fit instead of failing."""
    spec = BenchSpec(workload="synthetic-zipf", policies=["fcfs"], rates=[50.0], num_requests=12,
                     slo=SLO(mean_normalized_latency=10.0), warmup_requests=1)
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "64", "--max-model-len", "64",
                      "--no-engine-process") as srv:
        results = run_bench(spec, ClientConfig(srv.base_url))
    [run] = results["runs"]
    assert run["metrics"]["num_failed"] == 0, run["per_request"]["error_counts"]
    assert run["capped_to_context"]["max_model_len"] == 64 and run["capped_to_context"]["requests"] > 0
    assert "requests capped to fit the served max_model_len 64" in format_notes([results])
