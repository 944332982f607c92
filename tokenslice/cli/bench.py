"""`tokenslice bench`: load over HTTP against our servers (one per policy) or any OpenAI-compatible URL."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from tokenslice.cli.args import add_field_flag, add_priority_flags, number_list, policy_list, write_json
from tokenslice.config import CacheConfig, ModelConfig, SchedulerConfig

# Engine flags `bench --model` passes on to the servers it starts. Their default is None, not the
# config's: a flag not given is not passed, so the servers keep serve's own default.
BENCH_SERVER_FLAGS = ((SchedulerConfig, "max_batch_size"), (CacheConfig, "kv_cache_blocks"),
                      (ModelConfig, "max_model_len"), (SchedulerConfig, "preemption"), (ModelConfig, "dtype"))


def cmd_bench(a: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    import httpx
    from tqdm import tqdm

    from tokenslice.bench.client_config import ClientConfig
    from tokenslice.bench.metrics import SLO
    from tokenslice.bench.report import format_summary, format_table, plot_results
    from tokenslice.bench.run_notes import format_notes
    from tokenslice.bench.sweep import BenchSpec, ServerSpec, run_bench
    from tokenslice.model.known_models import known_model

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    policies = [p.strip() for p in a.policy.split(",") if p.strip()] if a.policy else []
    server = None
    tokenizer = a.tokenizer
    if a.model:
        if not policies:
            raise ValueError("--model needs --policy (comma-separated policies to compare)")
        policy_list(a.policy)  # each starts a server: refuse a bad name before the first one
        args = shlex.split(a.server_args or "")
        for name in [n for _, n in BENCH_SERVER_FLAGS] + ["profile"]:
            if getattr(a, name) is not None:
                args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
        server = ServerSpec(model=a.model, args=args, threads=a.server_threads, api_key=a.api_key, port=a.port)
        if tokenizer is None and (Path(a.model).is_dir() or a.model.lower().endswith(".gguf")
                                  or known_model(a.model) is not None):
            tokenizer = a.model  # count dataset tokens as the served model does
    else:
        policies = policies or ["server"]
    slo_auto = a.slo_normalized_latency == "auto"
    slo = SLO(None if slo_auto or a.slo_normalized_latency is None else float(a.slo_normalized_latency),
              a.slo_ttft, a.slo_tpot)
    spec = BenchSpec(
        workload=a.workload, policies=policies, rates=number_list(a.rates) if a.rates else None,
        concurrency=number_list(a.concurrency, int) if a.concurrency else None, num_requests=a.num_requests,
        cv=a.cv, seed=a.seed, dataset=a.dataset, tokenizer=tokenizer, max_tokens_cap=a.max_tokens_cap,
        max_prompt_len=a.max_prompt_len, length_filter=a.length_filter, input_len=a.input_len,
        output_len=a.output_len, min_len=a.min_len, max_len=a.max_len, slo=slo, slo_auto=slo_auto,
        slo_attainment=a.slo_attainment, early_stop_factor=a.early_stop_factor or None, warmup_requests=a.warmup,
        interleave=a.interleave, num_users=a.num_users, user_shares=a.user_shares,
        priority_pattern=a.priority_pattern,
        priority_update_freq=a.priority_update_freq, priority_levels=a.priority_levels, iteration_s=a.iteration_s,
        wait_compiled=a.wait_compiled, wait_compiled_timeout_s=a.wait_compiled_timeout_s)
    send_length = {"auto": a.model is not None, "on": True, "off": False}[a.expected_length]
    client = ClientConfig(base_url=a.url or "", model=a.served_model, api_key=a.api_key, endpoint=a.endpoint,
                          ignore_eos=not a.no_ignore_eos, send_expected_length=send_length,
                          temperature=a.temperature, seed=a.seed, request_timeout_s=a.request_timeout,
                          max_concurrency=a.max_concurrency, prompt_format=a.prompt_format,
                          history_max_chars=a.history_max_chars)
    client.validate()
    if a.url:
        check_reachable(client)
    with tqdm(desc="bench", unit="req", file=sys.stderr, disable=a.quiet) as bar:
        def tick(desc: str, done: int, total: int) -> None:
            if bar.total != total or done == 1:
                bar.reset(total)
                bar.set_description_str(desc, refresh=False)
            bar.update(done - bar.n)

        try:
            results = run_bench(spec, client, server, progress=tick)
        except httpx.HTTPError as e:  # the server went away mid-run: say so in one line
            raise ValueError(f"lost the server at {client.root or 'the started server'}: {_why(e)}") from None
    print(format_summary([results], [a.workload]))
    print(format_table([results]))
    notes = format_notes([results])
    if notes:
        print(notes)
    if a.out:
        write_json(a.out, results)
    if a.plot:
        print(f"wrote {plot_results([results], a.plot)}")
    return 0


def _why(e: Exception) -> str:
    return str(e) or type(e).__name__


def check_reachable(client: Any) -> None:
    """A one-line error (no traceback) when --url does not answer /v1/models."""
    import httpx

    from tokenslice.bench.client_config import CONTROL_TIMEOUT_S

    url = client.root + "/v1/models"
    try:
        r = httpx.get(url, headers=client.headers(), timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {client.root}: {_why(e)} (is the server running there?)") from None
    if r.status_code != 200:
        raise ValueError(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")


def add_subcommand(sub: Any) -> None:
    from tokenslice.bench.client_config import ENDPOINTS, PROMPT_FORMATS, ClientConfig
    from tokenslice.bench.sweep import BenchSpec
    from tokenslice.bench.workloads import WORKLOAD_NAMES

    b = sub.add_parser("bench", help="benchmark over HTTP: policies x rates against real servers, "
                       "or any OpenAI-compatible URL")

    def spec(name: str, **kwargs: Any) -> None:
        add_field_flag(b, BenchSpec, name, **kwargs)

    def client(name: str, **kwargs: Any) -> None:
        add_field_flag(b, ClientConfig, name, **kwargs)

    target = b.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="an OpenAI-compatible server to benchmark (base URL, with or without /v1)")
    target.add_argument("--model", help="start `tokenslice serve --model MODEL` per policy (a Hugging Face "
                        "directory or builtin:tiny)")
    b.add_argument("--api-key", default=os.environ.get("TOKENSLICE_API_KEY"),
                   help="sent as a Bearer token (default: $TOKENSLICE_API_KEY)")
    b.add_argument("--served-model", default=None, help="model name to send (default: the first of /v1/models)")
    b.add_argument("--policy", default=None, help="with --model: comma-separated policies, one server each; "
                   "with --url: a label for the server")
    b.add_argument("--workload", required=True, choices=list(WORKLOAD_NAMES))
    b.add_argument("--dataset", default=None, help="dataset file or directory (alpaca/sharegpt workloads)")
    b.add_argument("--tokenizer", default=None, help="tokenizer directory that counts dataset tokens "
                   "(default with --model DIR: the model's)")
    points = b.add_mutually_exclusive_group(required=True)
    points.add_argument("--rates", help="comma-separated arrival rates (req/s), open loop")
    points.add_argument("--concurrency", help="comma-separated fixed numbers of requests in flight (closed loop)")
    spec("cv", help="arrival-gap coefficient of variation (1: Poisson)")
    client("max_concurrency", help="cap on requests in flight at any rate")
    spec("num_requests")
    spec("seed")
    spec("max_tokens_cap")
    spec("max_prompt_len")
    spec("length_filter", help="vLLM's benchmark length filter")
    spec("input_len", help="synthetic workloads: prompt length (mean)")
    spec("output_len", help="synthetic workloads: output length (mean)")
    spec("min_len", help="synthetic workloads: shortest length")
    spec("max_len", help="synthetic workloads: longest length")
    b.add_argument("--slo-normalized-latency", default=None, help="s/token, or 'auto': 10x the decode step "
                   "a lone request sees on the first server (the paper protocol)")
    b.add_argument("--slo-ttft", type=float, default=None, help="per-request TTFT bound (s)")
    b.add_argument("--slo-tpot", type=float, default=None, help="per-request TPOT bound (s)")
    spec("slo_attainment", help="without a normalized-latency SLO: share of requests that must meet TTFT/TPOT")
    spec("early_stop_factor", help="stop a policy's sweep once past this x the SLO (0: run every point)")
    client("endpoint", choices=list(ENDPOINTS))
    client("prompt_format", choices=list(PROMPT_FORMATS),
           help="auto: dataset text (else token ids); synthetic: token ids of each request's length")
    b.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may end early)")
    b.add_argument("--expected-length", default="auto", choices=["auto", "on", "off"],
                   help="send tokenslice.expected_output_tokens (for srpt-oracle; auto: with --model)")
    client("temperature")
    b.add_argument("--request-timeout", type=float, default=ClientConfig.request_timeout_s,
                   help="seconds; a request past it fails")
    client("history_max_chars", help="multi-turn: drop a conversation's oldest turns beyond this many characters")
    b.add_argument("--warmup", type=int, default=BenchSpec.warmup_requests,
                   help="unrecorded requests sent to each server first")
    spec("wait_compiled", action=argparse.BooleanOptionalAction,
         help="on by default: load each server only once /v1/state says its compiled decode is built (ready, off "
              "or failed; servers that do not say are not waited for); --no-wait-compiled: load at once")
    spec("wait_compiled_timeout_s", metavar="SECONDS",
         help="give up (an error) when it is still being built after this")
    srv = b.add_argument_group("servers started with --model", "engine flags below are passed on to each "
                               "`tokenslice serve` when given; servers keep serve's default for the rest")
    for cls, name in BENCH_SERVER_FLAGS:
        add_field_flag(srv, cls, name, default=None)
    srv.add_argument("--profile", default=None, help="cost model the policies use (see `serve --profile`)")
    srv.add_argument("--server-threads", type=int, default=None, help="torch threads in each server")
    srv.add_argument("--port", type=int, default=None, help="the first server's port, the next policy's server "
                     "takes the next one (default: free ports)")
    srv.add_argument("--server-args", default=None, help="further `serve` flags, as one quoted string")
    add_priority_flags(b, BenchSpec)
    spec("iteration_s", metavar="SECONDS", help="with --priority-pattern: the server's iteration time, which turns "
         "1/F iterations into wall time (default: a lone request's decode step, measured)")
    add_field_flag(srv, BenchSpec, "interleave", help="start every policy's server at once and let the policies "
                   "take turns at each rate, so that drifting machine load hits all alike")
    b.add_argument("--out", default=None, help="write the results file (docs/DESIGN.md format)")
    b.add_argument("--plot", default=None, help="write a PNG figure")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
