"""The `tokenslice` command. Each subcommand lives in a function `cmd_<name>`; flags are the
kebab-case names of config fields (DESIGN.md)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, EMBED_DTYPES, PREEMPTION_MODES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds an engine."""
    p.add_argument("--model", default="builtin:tiny", help="local Hugging Face directory or builtin:tiny")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="random seed (generate: the sampling seed)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-blocks", type=int, default=None)
    p.add_argument("--kv-memory-fraction", type=float, default=0.25)
    p.add_argument("--swap-space-gb", type=float, default=4.0,
                   help="host memory for swapped-out KV (reactive-swap / proactive-swap)")
    p.add_argument("--host-kv-blocks", type=int, default=None, help="host KV blocks (overrides --swap-space-gb)")
    p.add_argument("--offload-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: per-channel int8 KV on host, dequantized on upload")
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--preemption", default="recompute", choices=list(PREEMPTION_MODES))
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-tokens-per-step", type=int, default=2048)
    p.add_argument("--profile", default=None,
                   help="cost model for policy decisions: a `tokenslice profile` JSON or model@hardware")
    p.add_argument("--starvation-limit-s", type=float, default=None,
                   help="MLFQ: promote jobs waiting longer than this (default: from the SLO)")
    p.add_argument("--slo-normalized-latency", type=float, default=None, help="s/token; informs policy defaults")
    p.add_argument("--length-predictor", default=None, metavar="DIR",
                   help="output-length predictor directory from `tokenslice predictor build` (srpt-predicted)")
    _add_burst_args(p)


def _add_burst_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burst-reserve-jobs", type=int, default=2,
                   help="proactive-swap: keep free KV for this many new jobs (K)")
    p.add_argument("--burst-reserve-queues", type=int, default=1,
                   help="proactive-swap: ... or for the jobs of this many top queues (K')")
    p.add_argument("--eviction-amortization", type=float, default=16.0,
                   help="anti-thrashing: a job whose KV was just loaded is not evicted for another load "
                        "until its service reached this many times the load's cost (0: off)")
    p.add_argument("--srpt-aging", type=float, default=SchedulerConfig.srpt_aging,
                   help="srpt-predicted virtual aging: seconds of predicted work each second of waiting "
                        "cancels (0: pure SRPT; larger: closer to FCFS, shorter tails)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device,
                          max_model_len=a.max_model_len, seed=a.seed),
        cache=CacheConfig(block_size=a.block_size, kv_cache_blocks=a.kv_cache_blocks,
                          kv_memory_fraction=a.kv_memory_fraction, swap_space_gb=a.swap_space_gb,
                          host_kv_blocks=a.host_kv_blocks, offload_dtype=a.offload_dtype),
        scheduler=SchedulerConfig(policy=a.policy, preemption=a.preemption, max_batch_size=a.max_batch_size,
                                  max_tokens_per_step=a.max_tokens_per_step, starvation_limit_s=a.starvation_limit_s,
                                  slo_normalized_latency=a.slo_normalized_latency,
                                  burst_reserve_jobs=a.burst_reserve_jobs,
                                  burst_reserve_queues=a.burst_reserve_queues,
                                  eviction_amortization=a.eviction_amortization, srpt_aging=a.srpt_aging,
                                  length_predictor=a.length_predictor),
        profile=a.profile)


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenslice.engine.engine import Engine
    from tokenslice.request import SamplingParams

    engine = Engine.from_config(engine_config_from_args(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos)
    for out in engine.generate(a.prompt, params):
        print(out.text if not a.echo else (out.prompt or "") + out.text)
    return 0


def serve_app_from_args(a: argparse.Namespace) -> Any:
    """The FastAPI app `serve` runs (tests start it the same way)."""
    from tokenslice.engine.engine import Engine
    from tokenslice.server.app import ServerSettings, create_app

    if a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    if a.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {a.max_body_bytes}")
    engine = Engine.from_config(engine_config_from_args(a))
    settings = ServerSettings(served_model_name=a.served_model_name or a.model, api_key=a.api_key or None,
                              max_waiting=a.max_waiting, max_body_bytes=a.max_body_bytes)
    return create_app(engine, settings)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    app = serve_app_from_args(a)
    # Our own log line per request replaces uvicorn's access log (which would add nothing).
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=5)
    return 0


def _number_list(text: str, kind: type = float) -> list[Any]:
    """"1,2.5,4" -> [1.0, 2.5, 4.0] (flags that take several values)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None


def cmd_simulate(a: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from tokenslice.bench.report import format_summary, format_table, plot_results
    from tokenslice.bench.simulate import SweepSpec, run_sweep, strip_per_request, sweep_size
    from tokenslice.predict.cost import load_cost_model

    cost = load_cost_model(a.profile)
    spec = SweepSpec(
        workload=a.workload, policies=[p.strip() for p in a.policy.split(",") if p.strip()],
        preemption=a.preemption, rates=_number_list(a.rates) if a.rates else None,
        loads=_number_list(a.loads) if a.loads else None, cv=a.cv,
        seeds=_number_list(a.seeds, int) if a.seeds else [a.seed], num_requests=a.num_requests,
        max_batch_size=a.max_batch_size, max_tokens_per_step=a.max_tokens_per_step,
        kv_cache_blocks=a.kv_cache_blocks, host_kv_blocks=a.host_kv_blocks, offload_dtype=a.offload_dtype,
        burst_reserve_jobs=a.burst_reserve_jobs, burst_reserve_queues=a.burst_reserve_queues,
        eviction_amortization=a.eviction_amortization, srpt_aging=a.srpt_aging,
        block_size=a.block_size, slo_normalized_latency=a.slo_normalized_latency,
        starvation_limit_s=a.starvation_limit_s, mlfq_quantum_ratio=a.mlfq_quantum_ratio,
        mlfq_num_queues=a.mlfq_num_queues, dataset=a.dataset, tokenizer=a.tokenizer, io_ratio=a.io_ratio,
        length_filter=a.length_filter, max_tokens_cap=a.max_tokens_cap, max_prompt_len=a.max_prompt_len,
        length_predictor=a.length_predictor)
    spec.validate()
    profile = a.profile if cost.name == a.profile else f"{a.profile} ({cost.name})"
    with tqdm(total=sweep_size(spec), desc="simulate", unit="run", file=sys.stderr, disable=a.quiet) as bar:
        def tick(desc: str) -> None:
            bar.set_postfix_str(desc, refresh=False)
            bar.update()

        results = run_sweep(cost, spec, profile_name=profile, progress=tick)
    print(format_summary([results], [a.workload]))
    print(format_table([results]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results if a.save_requests else strip_per_request(results), f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}")
    if a.plot:
        print(f"wrote {plot_results([results], a.plot)}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenslice.bench.report import format_summary, format_table, load_results, plot_results

    results = load_results(a.results)
    stems = [Path(p).stem for p in a.results]
    names = stems if len(set(stems)) == len(stems) else list(a.results)
    print(format_summary(results, names))
    print(format_table(results, names))
    if a.plot:
        print(f"wrote {plot_results(results, a.plot, names)}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    import json
    import shlex
    from pathlib import Path

    from tqdm import tqdm

    from tokenslice.bench.client import ClientConfig
    from tokenslice.bench.metrics import SLO
    from tokenslice.bench.report import format_summary, format_table, plot_results
    from tokenslice.bench.sweep import BenchSpec, ServerSpec, run_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    policies = [p.strip() for p in a.policy.split(",") if p.strip()] if a.policy else []
    server = None
    tokenizer = a.tokenizer
    if a.model:
        if not policies:
            raise ValueError("--model needs --policy (comma-separated policies to compare)")
        args = shlex.split(a.server_args or "")
        for flag, value in (("--max-batch-size", a.max_batch_size), ("--kv-cache-blocks", a.kv_cache_blocks),
                            ("--max-model-len", a.max_model_len), ("--preemption", a.preemption),
                            ("--dtype", a.dtype), ("--profile", a.profile)):
            if value is not None:
                args += [flag, str(value)]
        server = ServerSpec(model=a.model, args=args, threads=a.server_threads, api_key=a.api_key)
        if tokenizer is None and Path(a.model).is_dir():
            tokenizer = a.model  # count dataset tokens as the served model does
    else:
        policies = policies or ["server"]
    slo_auto = a.slo_normalized_latency == "auto"
    slo = SLO(None if slo_auto or a.slo_normalized_latency is None else float(a.slo_normalized_latency),
              a.slo_ttft, a.slo_tpot)
    spec = BenchSpec(
        workload=a.workload, policies=policies, rates=_number_list(a.rates) if a.rates else None,
        concurrency=_number_list(a.concurrency, int) if a.concurrency else None, num_requests=a.num_requests,
        cv=a.cv, seed=a.seed, dataset=a.dataset, tokenizer=tokenizer, max_tokens_cap=a.max_tokens_cap,
        max_prompt_len=a.max_prompt_len, length_filter=a.length_filter, input_len=a.input_len,
        output_len=a.output_len, min_len=a.min_len, max_len=a.max_len, slo=slo, slo_auto=slo_auto,
        slo_attainment=a.slo_attainment, early_stop_factor=a.early_stop_factor or None, warmup_requests=a.warmup,
        interleave=a.interleave)
    send_length = {"auto": a.model is not None, "on": True, "off": False}[a.expected_length]
    client = ClientConfig(base_url=a.url or "", model=a.served_model, api_key=a.api_key, endpoint=a.endpoint,
                          ignore_eos=not a.no_ignore_eos, send_expected_length=send_length,
                          temperature=a.temperature, seed=a.seed, request_timeout_s=a.request_timeout,
                          max_concurrency=a.max_concurrency, prompt_format=a.prompt_format,
                          history_max_chars=a.history_max_chars)
    client.validate()
    with tqdm(desc="bench", unit="req", file=sys.stderr, disable=a.quiet) as bar:
        def tick(desc: str, done: int, total: int) -> None:
            if bar.total != total or done == 1:
                bar.reset(total)
                bar.set_description_str(desc, refresh=False)
            bar.update(done - bar.n)

        results = run_bench(spec, client, server, progress=tick)
    print(format_summary([results], [a.workload]))
    print(format_table([results]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}")
    if a.plot:
        print(f"wrote {plot_results([results], a.plot)}")
    return 0


def add_bench_subcommand(sub: Any) -> None:
    """`bench`: load over HTTP against our servers (one per policy) or any OpenAI-compatible URL."""
    from tokenslice.bench.client import ENDPOINTS, PROMPT_FORMATS
    from tokenslice.bench.workloads import WORKLOAD_NAMES

    b = sub.add_parser("bench", help="benchmark over HTTP: policies x rates against real servers, "
                       "or any OpenAI-compatible URL")
    target = b.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="an OpenAI-compatible server to benchmark (base URL, with or without /v1)")
    target.add_argument("--model", help="start `tokenslice serve --model MODEL` per policy (a Hugging Face "
                        "directory or builtin:tiny)")
    b.add_argument("--api-key", default=os.environ.get("TOKENSLICE_API_KEY"), help="sent as a Bearer token")
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
    b.add_argument("--cv", type=float, default=1.0, help="arrival-gap coefficient of variation (1: Poisson)")
    b.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight at any rate")
    b.add_argument("--num-requests", type=int, default=200)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-tokens-cap", type=int, default=None)
    b.add_argument("--max-prompt-len", type=int, default=None)
    b.add_argument("--length-filter", action="store_true", help="vLLM's benchmark length filter")
    b.add_argument("--input-len", type=int, default=128, help="synthetic workloads: prompt length (mean)")
    b.add_argument("--output-len", type=int, default=128, help="synthetic workloads: output length (mean)")
    b.add_argument("--min-len", type=int, default=1, help="synthetic workloads: shortest length")
    b.add_argument("--max-len", type=int, default=2048, help="synthetic workloads: longest length")
    b.add_argument("--slo-normalized-latency", default=None, help="s/token, or 'auto': 10x the decode step "
                   "a lone request sees on the first server (the paper protocol)")
    b.add_argument("--slo-ttft", type=float, default=None, help="per-request TTFT bound (s)")
    b.add_argument("--slo-tpot", type=float, default=None, help="per-request TPOT bound (s)")
    b.add_argument("--slo-attainment", type=float, default=0.9,
                   help="without a normalized-latency SLO: share of requests that must meet TTFT/TPOT")
    b.add_argument("--early-stop-factor", type=float, default=2.0,
                   help="stop a policy's sweep once past this x the SLO (0: run every point)")
    b.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS))
    b.add_argument("--prompt-format", default="auto", choices=list(PROMPT_FORMATS),
                   help="auto: dataset text (else token ids); synthetic: token ids of each request's length")
    b.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may end early)")
    b.add_argument("--expected-length", default="auto", choices=["auto", "on", "off"],
                   help="send tokenslice.expected_output_tokens (for srpt-oracle; auto: with --model)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--request-timeout", type=float, default=600.0, help="seconds; a request past it fails")
    b.add_argument("--history-max-chars", type=int, default=None,
                   help="multi-turn: drop a conversation's oldest turns beyond this many characters")
    b.add_argument("--warmup", type=int, default=4, help="unrecorded requests sent to each server first")
    srv = b.add_argument_group("servers started with --model")
    srv.add_argument("--max-batch-size", type=int, default=None)
    srv.add_argument("--kv-cache-blocks", type=int, default=None)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--preemption", default=None, choices=list(PREEMPTION_MODES))
    srv.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    srv.add_argument("--profile", default=None, help="cost model the policies use (see `serve --profile`)")
    srv.add_argument("--server-threads", type=int, default=None, help="torch threads in each server")
    srv.add_argument("--server-args", default=None, help="further `serve` flags, as one quoted string")
    srv.add_argument("--interleave", action="store_true", help="start every policy's server at once and let "
                     "the policies take turns at each rate, so that drifting machine load hits all alike")
    b.add_argument("--out", default=None, help="write the results file (DESIGN.md format)")
    b.add_argument("--plot", default=None, help="write a PNG figure")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)


def cmd_profile(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenslice.engine.profiler import ProfileOptions, describe, run_profile

    opts = ProfileOptions(model=a.model, dtype=a.dtype, device=a.device, max_batch_size=a.max_batch_size,
                          max_context=a.max_context, max_tokens_per_step=a.max_tokens_per_step, samples=a.samples,
                          repeats=a.repeats, block_size=a.block_size, seed=a.seed)
    with tqdm(desc="profile", unit="step", file=sys.stderr, disable=a.quiet) as bar:
        def tick(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = run_profile(opts, progress=tick)
    report.save(a.out)
    print(describe(report))
    print(f"wrote {a.out} (use it as: tokenslice simulate --profile {a.out} ...)")
    return 0


def add_simulation_subcommands(sub: Any) -> None:
    """`simulate`, `report` and `profile` (the simulator, its figures, and its cost model)."""
    from tokenslice.bench.workloads import WORKLOAD_NAMES

    m = sub.add_parser("simulate", help="sweep policies x rates (or loads) on the simulator")
    m.add_argument("--profile", required=True, help="cost model: model@hardware (e.g. opt-13b@a100-40gb) "
                   "or a profile .json from `tokenslice profile`")
    m.add_argument("--workload", required=True, choices=list(WORKLOAD_NAMES))
    m.add_argument("--dataset", default=None, help="dataset file or directory (alpaca/sharegpt workloads)")
    m.add_argument("--tokenizer", default=None, help="tokenizer directory that counts dataset tokens")
    m.add_argument("--policy", required=True, help="comma-separated policies, e.g. fcfs,skip-join-mlfq,srpt-oracle")
    m.add_argument("--preemption", default="recompute", choices=list(PREEMPTION_MODES))
    points = m.add_mutually_exclusive_group(required=True)
    points.add_argument("--rates", help="comma-separated arrival rates (req/s): the paper protocol")
    points.add_argument("--loads", help="comma-separated fractions of fcfs's saturation throughput on the "
                        "same setup: the steady-state protocol")
    m.add_argument("--cv", type=float, default=1.0, help="arrival-gap coefficient of variation (1: Poisson)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--seeds", default=None, help="comma-separated seeds (overrides --seed)")
    m.add_argument("--num-requests", type=int, default=1000)
    m.add_argument("--max-batch-size", type=int, default=16)
    m.add_argument("--max-tokens-per-step", type=int, default=2048)
    m.add_argument("--kv-cache-blocks", type=int, default=None,
                   help="device KV blocks (default: ample, every request of the workload fits at once)")
    m.add_argument("--host-kv-blocks", type=int, default=None,
                   help="host KV blocks for the swap modes (default: 4x the device pool)")
    m.add_argument("--offload-dtype", default="auto", choices=["auto", "int8"])
    _add_burst_args(m)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--slo-normalized-latency", type=float, default=None,
                   help="s/token (default: 10x the profile's decode iteration time)")
    m.add_argument("--starvation-limit-s", type=float, default=None)
    m.add_argument("--mlfq-quantum-ratio", type=float, default=2.0)
    m.add_argument("--mlfq-num-queues", type=int, default=16)
    m.add_argument("--io-ratio", type=float, default=None, help="rescale mean input:output length ratio")
    m.add_argument("--length-filter", action="store_true", help="vLLM's benchmark length filter")
    m.add_argument("--max-tokens-cap", type=int, default=None)
    m.add_argument("--max-prompt-len", type=int, default=None)
    m.add_argument("--length-predictor", default=None, metavar="DIR",
                   help="output-length predictor from `tokenslice predictor build` (srpt-predicted): each "
                   "request is predicted from its prompt text; build it on records the workload does not draw")
    m.add_argument("--out", default=None, help="write the results file (DESIGN.md format)")
    m.add_argument("--save-requests", action="store_true",
                   help="keep per-request data in --out (for TTFT/TBT CDFs in `report`)")
    m.add_argument("--plot", default=None, help="write a PNG figure")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.set_defaults(func=cmd_simulate)

    r = sub.add_parser("report", help="tables and figures from one or more results files")
    r.add_argument("results", nargs="+", help="results .json files (merged)")
    r.add_argument("--plot", default=None, help="write a PNG figure")
    r.set_defaults(func=cmd_report)

    p = sub.add_parser("profile", help="measure this machine and fit a cost model for the simulator")
    p.add_argument("--model", default="builtin:tiny", help="local Hugging Face directory or builtin:tiny")
    p.add_argument("--out", required=True, help="profile .json to write")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-context", type=int, default=None, help="longest context measured (default: "
                   "the model's, at most 1024)")
    p.add_argument("--max-tokens-per-step", type=int, default=2048)
    p.add_argument("--samples", type=int, default=None, help="grid points to measure (default: the full grid)")
    p.add_argument("--repeats", type=int, default=5, help="timings per point; the fastest is kept")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)


def _predictor_examples(a: argparse.Namespace, turns: str) -> list[Any]:
    from tokenslice.bench.lengthdata import load_examples, select

    try:
        examples = load_examples(a.dataset, a.tokenizer, turns=turns)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    return select(examples, a.split, a.test_size, a.split_seed)


def cmd_predictor_build(a: argparse.Namespace) -> int:
    import time

    from tokenslice.predict.length import LengthPredictor, PredictorConfig

    examples = _predictor_examples(a, a.turns)
    start = time.perf_counter()
    try:
        pred = LengthPredictor.create(a.out, PredictorConfig(embedder=a.embedder, embedder_dtype=a.embedder_dtype,
                                                               retrain_every=a.retrain_every))
    except (FileExistsError, FileNotFoundError) as e:
        raise ValueError(str(e)) from None
    with pred:
        pred.seed([e.prompt for e in examples], [e.output_len for e in examples],
                  groups=[e.group for e in examples], tune=not a.no_tune)
        cfg = pred.config
        tuned = "" if pred.tune_score is None else f", cross-validated Spearman {pred.tune_score:.3f}"
        print(f"seeded {pred.num_records} records from {a.dataset} in {time.perf_counter() - start:.1f}s: "
              f"k={cfg.k} threshold={cfg.threshold} knn_weight={cfg.knn_weight}{tuned}")
    print(f"wrote {a.out} (use it as: tokenslice serve --length-predictor {a.out} ...)")
    return 0


def cmd_predictor_eval(a: argparse.Namespace) -> int:
    import json

    from tokenslice.bench.length_eval import evaluate, format_table
    from tokenslice.predict.length import LengthPredictor

    # Held-out prompts are always first turns (a later turn's prompt lacks its conversation).
    examples = _predictor_examples(a, "first")
    try:
        pred = LengthPredictor.load(a.predictor, cache_size=0, background_training=False)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    with pred:
        result = evaluate(pred, [e.prompt for e in examples], [e.output_len for e in examples])
    result["dataset"] = str(a.dataset)
    result["split"] = {"part": a.split, "test_size": a.test_size, "seed": a.split_seed}
    print(format_table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}")
    return 0


def add_predictor_subcommands(sub: Any) -> None:
    """`predictor build` and `predictor eval`: the output-length predictor (ALISE §3.1)."""
    p = sub.add_parser("predictor", help="build or evaluate an output-length predictor")
    ps = p.add_subparsers(dest="predictor_command", required=True)

    def dataset_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--dataset", required=True, help="Alpaca or ShareGPT JSON file")
        q.add_argument("--tokenizer", required=True, help="tokenizer directory that counts output tokens")
        q.add_argument("--split", default="all", choices=["all", "train", "test"],
                       help="use the whole dataset, or one side of a seeded split (needs --test-size)")
        q.add_argument("--test-size", type=int, default=None, help="records (conversations) held out for test")
        q.add_argument("--split-seed", type=int, default=0)

    b = ps.add_parser("build", help="create a predictor seeded from a dataset (tunes and trains it)")
    dataset_args(b)
    b.add_argument("--out", required=True, help="predictor directory to create")
    b.add_argument("--turns", default="first", choices=["first", "all"],
                   help="ShareGPT: seed with each conversation's first human->gpt pair, or every pair")
    b.add_argument("--embedder", default=None,
                   help="sentence-embedding model directory (default: the installed all-MiniLM-L6-v2)")
    b.add_argument("--embedder-dtype", default="auto", choices=list(EMBED_DTYPES),
                   help="encoder weights' dtype; auto: bfloat16 where the CPU computes it natively")
    b.add_argument("--retrain-every", type=int, default=256, help="new records between MLP retrainings")
    b.add_argument("--no-tune", action="store_true", help="keep the default k / threshold / knn weight")
    b.set_defaults(func=cmd_predictor_build)

    e = ps.add_parser("eval", help="score a predictor and three baselines on a dataset (read-only)")
    dataset_args(e)
    e.add_argument("--predictor", required=True, help="predictor directory")
    e.add_argument("--out", default=None, help="write the results as JSON")
    e.set_defaults(func=cmd_predictor_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenslice", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="may be given several times")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("TOKENSLICE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENSLICE_API_KEY); "
                        "/health and /metrics stay open")
    s.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for their first token; more get 429 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    s.set_defaults(func=cmd_serve)
    add_simulation_subcommands(sub)
    add_bench_subcommand(sub)
    add_predictor_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenslice.model.arch import ModelLoadError
    from tokenslice.request import InvalidRequestError

    try:
        return args.func(args)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
