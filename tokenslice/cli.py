"""The `tokenslice` command. Each subcommand lives in a function `cmd_<name>`; flags are the
kebab-case names of config fields (docs/DESIGN.md)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import logging
import os
import sys
import typing
from typing import Any

from tokenslice.config import EMBED_DTYPES, CacheConfig, CpuConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenslice.request import SamplingParams
from tokenslice.sched.registry import POLICY_NAMES
from tokenslice.server.settings import ServerSettings


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default (most come from the config dataclasses, not from this file),
    unless it has none or its help already says "default: ..." itself."""

    def _format_action(self, action: argparse.Action) -> str:
        d = action.default
        if (action.option_strings and d is not None and d is not argparse.SUPPRESS and not isinstance(d, bool)
                and "default:" not in (action.help or "")):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def add_field_flag(p: Any, cls: type, name: str, *aliases: str, **kwargs: Any) -> argparse.Action:
    """Add `--name` (kebab case) for the field `name` of the dataclass `cls` (docs/DESIGN.md: flags are
    config field names), and short `aliases` (e.g. "-tp"): its default, type and choices come
    from the field, so none is written twice. `kwargs` go to argparse (help, metavar, required,
    ...) and win over the field's."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise AttributeError(f"{cls.__name__} has no field {name!r}")
    kind = _field_types(cls)[name]
    options = [t for t in typing.get_args(kind) if t is not type(None)]
    if len(options) == 1:  # X | None
        kind = options[0]
    if f.default is not dataclasses.MISSING:
        kwargs.setdefault("default", f.default)
    if kind is bool:
        kwargs.setdefault("action", "store_true")
    elif kind in (int, float):
        kwargs.setdefault("type", kind)
    if "choices" in f.metadata:
        kwargs.setdefault("choices", list(f.metadata["choices"]))
    return p.add_argument("--" + name.replace("_", "-"), *aliases, **kwargs)


def policy_list(text: str) -> list[str]:
    """A comma-separated --policy list; each must be a policy that exists (sched/registry.py).
    Checked before any simulation or server starts; ValueError names the unknown ones."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or repr(text)}; choose from {', '.join(POLICY_NAMES)}")
    return names


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds an engine: one per engine setting, named and
    defaulted by its config field (engine_config_from_args routes them back)."""
    def flag(cls: type, name: str, **kwargs: Any) -> None:
        add_field_flag(p, cls, name, **kwargs)

    flag(ModelConfig, "model", help="local Hugging Face directory or builtin:tiny")
    flag(ModelConfig, "tokenizer", help="tokenizer directory (default: the model's)")
    flag(ModelConfig, "dtype")
    flag(ModelConfig, "device")
    flag(ModelConfig, "max_model_len", help="longest prompt + output (default: the checkpoint's context)")
    flag(ModelConfig, "seed", help="random seed (generate: the sampling seed)")
    flag(ModelConfig, "persistent_batch", action=argparse.BooleanOptionalAction,
         help="keep decode block tables between steps, updating what changed (on by default); "
              "off: rebuild them every step")
    flag(ModelConfig, "compile", action=argparse.BooleanOptionalAction,
         help="CPU: run decode steps compiled by torch.compile (inductor; 15-40 s at start-up); "
              "default: on for serve, off otherwise")
    flag(ModelConfig, "cuda_graphs", action=argparse.BooleanOptionalAction,
         help="CUDA: replay decode steps from CUDA graphs captured at start-up (on by default)")
    flag(CacheConfig, "block_size")
    flag(CacheConfig, "kv_cache_blocks", help="device KV blocks (overrides --kv-memory-fraction)")
    flag(CacheConfig, "kv_memory_fraction", help="share of free device memory (on CPU: of available RAM) for KV")
    flag(CacheConfig, "swap_space_gb", help="host memory for swapped-out KV (reactive-swap / proactive-swap)")
    flag(CacheConfig, "host_kv_blocks", help="host KV blocks (overrides --swap-space-gb)")
    flag(CacheConfig, "offload_dtype", help="int8: per-channel int8 KV on host, dequantized on upload")
    flag(CacheConfig, "enable_prefix_caching", action=argparse.BooleanOptionalAction,
         help="reuse cached KV of shared prompt prefixes (on by default)")
    flag(CacheConfig, "block_groups", action=argparse.BooleanOptionalAction,
         help="swap modes: place a request's KV in few contiguous runs, so a swap is few copies "
              "(FastSwitch); off: one copy per block as vLLM")
    add_field_flag(p, ParallelConfig, "tensor_parallel_size", "-tp",
                   help="split the model over this many ranks (Megatron-style tensor parallelism)")
    add_field_flag(p, ParallelConfig, "pipeline_parallel_size", "-pp",
                   help="split the layers into this many stages, each of tensor-parallel-size ranks, with as "
                        "many batches in flight (FastServe pipeline parallelism)")
    add_field_flag(p, ParallelConfig, "pipeline_layers", metavar="N,N,...",
                   help="layers per pipeline stage, first stage first (default: equal counts); the last stage "
                        "also computes the LM head")
    flag(ParallelConfig, "executor", help="where the model runs: mp = one worker process per rank, "
                                          "ray = one Ray actor per rank, on one node or several "
                                          "(auto: mp with several ranks, else in this process)")
    flag(ParallelConfig, "ray_address", metavar="auto|HOST:PORT",
         help="executor ray: the Ray cluster to join (auto: the one `ray start` runs on this node); "
              "unset: $RAY_ADDRESS, else a private cluster on this machine")
    flag(SchedulerConfig, "policy", choices=list(POLICY_NAMES))
    flag(SchedulerConfig, "preemption")
    flag(SchedulerConfig, "swap_in",
         help="swap-ins: as the mode does, sync, async, or adaptive from measured copy times (FastSwitch)")
    flag(SchedulerConfig, "swap_in_async_fraction",
         help="adaptive swap-in: async once a copy's expected time exceeds this share of a step")
    flag(SchedulerConfig, "max_batch_size")
    flag(SchedulerConfig, "max_tokens_per_step")
    flag(EngineConfig, "profile",
         help="cost model for policy decisions: a `tokenslice profile` JSON or model@hardware")
    flag(EngineConfig, "step_trace", metavar="FILE",
         help="append one JSON line per engine step (batch, queues, swap work, loop time split)")
    flag(SchedulerConfig, "starvation_limit_s",
         help="MLFQ: promote jobs waiting longer than this (default: from the SLO)")
    flag(SchedulerConfig, "slo_normalized_latency", help="s/token; informs policy defaults")
    flag(SchedulerConfig, "length_predictor", metavar="DIR",
         help="output-length predictor directory from `tokenslice predictor build` (srpt-predicted)")
    flag(SchedulerConfig, "length_predictor_store_text",
         help="also store each finished prompt's text in the predictor's history (default: only its "
              "embedding and lengths)")
    _add_scheduler_tuning_args(p, SchedulerConfig)


def _add_scheduler_tuning_args(p: argparse.ArgumentParser, cls: type) -> None:
    """The policies' and preemption's knobs, for the engine (SchedulerConfig) and for sweeps
    (bench.simulate.SweepSpec, whose fields of these names carry SchedulerConfig's defaults)."""
    add_field_flag(p, cls, "burst_reserve_jobs", help="proactive-swap: keep free KV for this many new jobs (K)")
    add_field_flag(p, cls, "burst_reserve_queues",
                   help="proactive-swap: ... or for the jobs of this many top queues (K')")
    add_field_flag(p, cls, "eviction_amortization",
                   help="anti-thrashing: a job whose KV was just loaded is not evicted for another load "
                        "until its service reached this many times the load's cost (0: off)")
    add_field_flag(p, cls, "srpt_aging",
                   help="srpt-predicted virtual aging: seconds of predicted work each second of waiting "
                        "cancels (0: pure SRPT; larger: closer to FCFS, shorter tails)")
    add_field_flag(p, cls, "mlfq_quantum_ratio", help="MLFQ: each queue's quantum is this many times the one above")
    add_field_flag(p, cls, "mlfq_num_queues", help="MLFQ: number of priority queues")
    add_field_flag(p, cls, "vtc_input_weight", help="vtc: service counted per input (prompt) token")
    add_field_flag(p, cls, "vtc_output_weight", help="vtc: service counted per output token")
    add_field_flag(p, cls, "vtc_weights", metavar="USER=W,...",
                   help="vtc: users' shares (the OpenAI `user` field); unlisted users weigh 1")


def add_priority_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """Users and FastSwitch §4's priority patterns, for `simulate` (SweepSpec) and `bench` (BenchSpec)."""
    add_field_flag(p, cls, "num_users", help="spread requests uniformly over this many users (fairness metrics)")
    add_field_flag(p, cls, "user_shares", metavar="S1,S2,...",
                   help="draw each request's user by these shares instead (10,1,1,1: one user sends 10x each "
                        "other's rate)")
    add_field_flag(p, cls, "priority_pattern", help="give requests priorities from this pattern at arrival and "
                   "change the live ones' every 1/f iterations (FastSwitch §4; default: no priorities)")
    add_field_flag(p, cls, "priority_update_freq", metavar="F",
                   help="with --priority-pattern: update priorities every 1/F iterations (0.01: every 100)")
    add_field_flag(p, cls, "priority_levels", help="with --priority-pattern: number of priority levels")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine flags (add_engine_args) back into an EngineConfig: each by its field name."""
    names = set(EngineConfig.option_names())
    return EngineConfig.from_options(**{k: v for k, v in vars(a).items() if k in names})


# Tokens `generate` samples per prompt unless --max-tokens says otherwise.
GENERATE_MAX_TOKENS = 64


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenslice.engine.engine import Engine

    engine = Engine.from_config(engine_config_from_args(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos, min_p=a.min_p,
                            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                            repetition_penalty=a.repetition_penalty)
    try:
        for out in engine.generate(a.prompt, params):
            print(out.text if not a.echo else (out.prompt or "") + out.text)
    finally:
        engine.close()  # ends worker processes and closes the step trace
    return 0


def serve_engine_config(a: argparse.Namespace) -> EngineConfig:
    """`serve`'s engine: the flags, with compiled decode on unless --no-compile (ModelConfig.compile)."""
    config = engine_config_from_args(a)
    if config.model.compile is None:
        config.model.compile = True
    return config


def serve_app_from_args(a: argparse.Namespace) -> Any:
    """The FastAPI app `serve` runs (tests start it the same way). With --engine-process (the
    default) the engine core starts here, in its own process, and is ready when this returns."""
    from tokenslice.server.app import create_app
    from tokenslice.server.settings import ServerSettings

    if a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    if a.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {a.max_body_bytes}")
    settings = ServerSettings(served_model_name=a.served_model_name or a.model, api_key=a.api_key or None,
                              max_waiting=a.max_waiting, max_body_bytes=a.max_body_bytes,
                              engine_process=a.engine_process)
    config = serve_engine_config(a)
    engine: Any
    if settings.engine_process:
        from tokenslice.engine.core_client import EngineCoreClient

        engine = EngineCoreClient(config, max_waiting=settings.max_waiting,
                                  log_level=logging.getLogger().getEffectiveLevel(), cpus=cpu_plan_from_args(a))
    else:
        from tokenslice.engine.async_engine import AsyncEngine
        from tokenslice.engine.engine import Engine

        engine = AsyncEngine(Engine.from_config(config), max_waiting=settings.max_waiting)
    return create_app(engine, settings)


def cpu_plan_from_args(a: argparse.Namespace) -> Any:
    """The serve flags' CPU split (engine/cpus.py CpuPlan)."""
    from tokenslice.engine.cpus import plan_cpus

    return plan_cpus(CpuConfig(a.api_server_cpus, a.engine_threads, a.pin_cpus))


def claim_server_cpus(a: argparse.Namespace) -> None:
    """This process's share of the CPU split: `serve` only (tests run servers inside pytest).
    With the core in its own process (which pins itself), the API server stays on its CPUs;
    with the engine on a thread here, its torch threads leave the event loop its CPUs."""
    from tokenslice.engine.cpus import pin_process

    plan = cpu_plan_from_args(a)
    if a.engine_process:
        if plan.pin:
            pin_process(plan.api_cpus)
    else:
        import torch

        torch.set_num_threads(plan.engine_threads)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from tokenslice.engine.core_client import EngineStartupError

    try:
        app = serve_app_from_args(a)
    except EngineStartupError as e:  # as main() answers the same errors raised in this process
        print(f"error: {e}", file=sys.stderr)
        return 2
    claim_server_cpus(a)
    # Our own log line per request replaces uvicorn's access log (which would add nothing).
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level.lower(),
                                           access_log=False, timeout_graceful_shutdown=5))
    died = False

    def on_dead() -> None:
        # A dead engine cannot come back: stop, and exit non-zero so that a supervisor restarts us.
        nonlocal died
        died = True
        server.should_exit = True

    app.state.server.async_engine.on_dead = on_dead
    server.run()
    if died:
        print("error: the engine died; the server stopped", file=sys.stderr)
        return 1
    return 0


def cmd_view(a: argparse.Namespace) -> int:
    import uvicorn

    from tokenslice.server.replay import create_replay_app

    print(f"indexing {a.file}", file=sys.stderr)
    app = create_replay_app(a.file)
    print(f"replaying {a.file} at http://{a.host}:{a.port}/dashboard", file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False)
    return 0


def write_json(path: str, data: Any) -> None:
    """Write a command's results file (indented JSON) and say so."""
    import json

    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def _number_list(text: str, kind: type = float) -> list[Any]:
    """"1,2.5,4" -> [1.0, 2.5, 4.0] (flags that take several values)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None


def cmd_simulate(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenslice.bench.report import format_summary, format_table, plot_results
    from tokenslice.sim.simulate import SweepSpec, run_sweep, strip_per_request, sweep_size
    from tokenslice.predict.cost import load_cost_model

    cost = load_cost_model(a.profile)
    # Flags named like SweepSpec fields map onto them; the lists are parsed here.
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(SweepSpec) if hasattr(a, f.name)}
    spec = SweepSpec(**{**given, "policies": policy_list(a.policy),
                        "rates": _number_list(a.rates) if a.rates else None,
                        "loads": _number_list(a.loads) if a.loads else None,
                        "seeds": _number_list(a.seeds, int) if a.seeds else [a.seed]})
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
        write_json(a.out, results if a.save_requests else strip_per_request(results))
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
    import shlex
    from pathlib import Path

    from tqdm import tqdm

    from tokenslice.bench.client_config import ClientConfig
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
        policy_list(a.policy)  # each starts a server: refuse a bad name before the first one
        args = shlex.split(a.server_args or "")
        for name in [n for _, n in BENCH_SERVER_FLAGS] + ["profile"]:
            if getattr(a, name) is not None:
                args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
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
        interleave=a.interleave, num_users=a.num_users, user_shares=a.user_shares,
        priority_pattern=a.priority_pattern,
        priority_update_freq=a.priority_update_freq, priority_levels=a.priority_levels, iteration_s=a.iteration_s)
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
        write_json(a.out, results)
    if a.plot:
        print(f"wrote {plot_results([results], a.plot)}")
    return 0


# Engine flags `bench --model` passes on to the servers it starts. Their default is None, not the
# config's: a flag not given is not passed, so the servers keep serve's own default.
BENCH_SERVER_FLAGS = ((SchedulerConfig, "max_batch_size"), (CacheConfig, "kv_cache_blocks"),
                      (ModelConfig, "max_model_len"), (SchedulerConfig, "preemption"), (ModelConfig, "dtype"))


def add_bench_subcommand(sub: Any) -> None:
    """`bench`: load over HTTP against our servers (one per policy) or any OpenAI-compatible URL."""
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
    srv = b.add_argument_group("servers started with --model", "engine flags below are passed on to each "
                               "`tokenslice serve` when given; servers keep serve's default for the rest")
    for cls, name in BENCH_SERVER_FLAGS:
        add_field_flag(srv, cls, name, default=None)
    srv.add_argument("--profile", default=None, help="cost model the policies use (see `serve --profile`)")
    srv.add_argument("--server-threads", type=int, default=None, help="torch threads in each server")
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


def cmd_twin(a: argparse.Namespace) -> int:
    from tokenslice.sim.twin import TwinSpec, format_twin, run_twin

    logging.getLogger("httpx").setLevel(logging.WARNING)
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(TwinSpec) if hasattr(a, f.name)}
    spec = TwinSpec(**{**given, "policies": policy_list(a.policy)})
    spec.validate()

    def tick(message: str) -> None:
        if not a.quiet:
            print(message, file=sys.stderr, flush=True)

    result = run_twin(spec, progress=tick)
    print(format_twin(result))
    if a.out:
        write_json(a.out, result)
    return 0


def add_twin_subcommand(sub: Any) -> None:
    """`twin`: one arrival trace on the real engine over HTTP and in the simulator, compared."""
    from tokenslice.sim.twin import TwinSpec
    from tokenslice.bench.workloads import WORKLOAD_NAMES

    t = sub.add_parser("twin", help="replay one arrival trace on the real engine (HTTP) and in the simulator "
                       "with the machine's profile; print both sides' latency and the simulator's error")

    def flag(name: str, **kwargs: Any) -> None:
        add_field_flag(t, TwinSpec, name, **kwargs)

    flag("model", required=True, help="model to serve (local Hugging Face directory or builtin:tiny)")
    t.add_argument("--policy", required=True, help=f"comma-separated policies, one server each (of "
                   f"{', '.join(POLICY_NAMES)})")
    flag("workload", choices=list(WORKLOAD_NAMES))
    flag("dataset", help="dataset file or directory (alpaca/sharegpt workloads)")
    flag("tokenizer", help="tokenizer directory that counts dataset tokens")
    points = t.add_mutually_exclusive_group(required=True)
    add_field_flag(points, TwinSpec, "rate", help="arrival rate (req/s)")
    add_field_flag(points, TwinSpec, "load", help="fraction of the real engine's fcfs saturation throughput "
                   "(measured over HTTP first, all requests at once, unless --saturation-rps)")
    flag("saturation_rps", help="with --load: the saturation throughput (req/s), not measured")
    flag("cv", help="arrival-gap coefficient of variation (1: Poisson)")
    flag("num_requests")
    flag("seed")
    flag("repeats", help="real runs of the trace (their spread is the real engine's own noise)")
    flag("profile", help="cost model JSON from `tokenslice profile` on this machine (default: profile first)")
    flag("sim_profile", help="cost model for the simulator's clock only (e.g. fitted on step traces); the "
         "policies on both sides keep --profile")
    flag("dtype")
    flag("max_batch_size", help="the scheduling benchmarks' batch, as `simulate`'s")
    for name in ("max_tokens_per_step", "block_size", "preemption", "max_prompt_len", "max_tokens_cap"):
        flag(name)  # as serve's and simulate's
    flag("length_filter", help="vLLM's benchmark length filter")
    flag("input_len", help="synthetic workloads: prompt length (mean)")
    flag("output_len", help="synthetic workloads: output length (mean)")
    flag("server_threads", help="torch threads in each server")
    flag("url", help="an already running tokenslice server (one policy) instead of starting servers")
    flag("server_step_trace", metavar="FILE", help="with --url: the file the server's --step-trace writes "
         "(needed for the serving path and the step comparison)")
    flag("step_trace_dir", metavar="DIR", help="keep the servers' and the simulator's step traces here")
    flag("serving_path", action=argparse.BooleanOptionalAction,
         help="model the HTTP path (in and out, measured on lone requests) in the simulator")
    flag("warmup_requests", help="unrecorded requests sent to each server first")
    t.add_argument("--out", default=None, help="write the comparison as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress lines")
    t.set_defaults(func=cmd_twin)


def cmd_profile(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenslice.sim.profile_options import ProfileOptions
    from tokenslice.sim.profiler import describe, profile_from_traces, run_profile
    from tokenslice.sim.trace_fit import describe_errors, evaluate_trace
    from tokenslice.predict.cost import load_cost_model

    if a.out is None and (a.from_trace or not a.evaluate):
        raise ValueError("profile: --out is required (the profile .json to write)")
    if a.evaluate and not (a.profile or a.from_trace):
        raise ValueError("profile --evaluate: name the profile to check (--profile) or fit one (--from-trace)")
    opts = ProfileOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ProfileOptions)})
    if a.from_trace:
        cost = profile_from_traces(opts, a.from_trace)
        cost.save(a.out)
        print(f"profile of {cost.name} fitted on {cost.samples} traced steps; per-step loop time "
              + ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in cost.loop.items()))
        print(f"wrote {a.out} (use it as: tokenslice simulate --profile {a.out} ...)")
    if a.evaluate:
        cost = load_cost_model(a.out if a.from_trace else a.profile)
        print(f"per-step |predicted - actual| / actual of {cost.name} on {a.evaluate}:")
        print(describe_errors(evaluate_trace(cost, a.evaluate, opts.block_size)))
    if a.from_trace or a.evaluate:
        return 0
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
    from tokenslice.sim.simulate import HOST_KV_FACTOR, SweepSpec
    from tokenslice.bench.workloads import WORKLOAD_NAMES
    from tokenslice.sim.profile_options import ProfileOptions

    m = sub.add_parser("simulate", help="sweep policies x rates (or loads) on the simulator")

    def flag(name: str, **kwargs: Any) -> None:
        add_field_flag(m, SweepSpec, name, **kwargs)

    m.add_argument("--profile", required=True, help="cost model: model@hardware[:tpN][:ppM][:nvlink|:pcie] (e.g. "
                   "opt-13b@a100-40gb, opt-66b@a100-40gb:tp4: tensor parallel over the card's own GPU link, "
                   "or over PCIe with :pcie; opt-175b@a100-40gb:tp8:pp2: two pipeline stages of 8 GPUs, one "
                   "batch in flight per stage) or a profile .json from `tokenslice profile`")
    flag("workload", required=True, choices=list(WORKLOAD_NAMES))
    flag("dataset", help="dataset file or directory (alpaca/sharegpt workloads)")
    flag("tokenizer", help="tokenizer directory that counts dataset tokens")
    m.add_argument("--policy", required=True,
                   help=f"comma-separated policies, e.g. fcfs,skip-join-mlfq,srpt-oracle (of {', '.join(POLICY_NAMES)})")
    flag("preemption")
    points = m.add_mutually_exclusive_group(required=True)
    points.add_argument("--rates", help="comma-separated arrival rates (req/s): the paper protocol")
    points.add_argument("--loads", help="comma-separated fractions of fcfs's saturation throughput on the "
                        "same setup: the steady-state protocol")
    flag("cv", help="arrival-gap coefficient of variation (1: Poisson)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--seeds", default=None, help="comma-separated seeds (overrides --seed)")
    flag("num_requests")
    flag("max_batch_size", help=f"smaller than serve's ({SchedulerConfig.max_batch_size}): the scheduling "
         "benchmarks' batch (BENCHMARKS.md), small enough that the queue builds and the order matters")
    flag("max_tokens_per_step")
    flag("kv_cache_blocks", help="device KV blocks (default: ample, every request of the workload fits at once)")
    flag("host_kv_blocks", help=f"host KV blocks for the swap modes (default: {HOST_KV_FACTOR}x the device pool)")
    flag("offload_dtype")
    flag("enable_prefix_caching", action=argparse.BooleanOptionalAction,
         help="share cached KV of equal prompt prefixes (dataset workloads: synthetic prompts never share)")
    flag("block_groups", action=argparse.BooleanOptionalAction,
         help="swap modes: few contiguous runs per request (FastSwitch); off: one copy per block as vLLM")
    _add_scheduler_tuning_args(m, SweepSpec)
    flag("block_size")
    flag("slo_normalized_latency", help="s/token (default: 10x the profile's decode iteration time)")
    flag("starvation_limit_s", help="MLFQ: promote jobs waiting longer than this (default: from the SLO)")
    flag("io_ratio", help="rescale mean input:output length ratio")
    flag("length_filter", help="vLLM's benchmark length filter")
    flag("record_state", metavar="FILE", help="write the scheduler's state (queues, requests, KV pools; no "
         "text or token ids) as JSON lines on the virtual clock, every run of the sweep")
    flag("record_state_interval_s", metavar="S", help="--record-state: at most one snapshot per this many "
         "simulated seconds per run")
    flag("max_tokens_cap")
    flag("max_prompt_len")
    flag("length_predictor", metavar="DIR",
         help="output-length predictor from `tokenslice predictor build` (srpt-predicted): each "
         "request is predicted from its prompt text; build it on records the workload does not draw")
    add_priority_flags(m, SweepSpec)
    m.add_argument("--out", default=None, help="write the results file (docs/DESIGN.md format)")
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
    p.add_argument("-o", "--out", default=None, help="profile .json to write")
    p.add_argument("--from-trace", nargs="+", metavar="TRACE", default=None,
                   help="fit on step traces of real runs (--step-trace) of --model instead of timing a grid")
    p.add_argument("--evaluate", metavar="TRACE", default=None,
                   help="print the per-step error distribution of a profile on a (held-out) step trace")
    p.add_argument("--profile", default=None, help="--evaluate: the profile .json to check (default: the one "
                   "--from-trace fits)")
    for name, text in (("model", "local Hugging Face directory or builtin:tiny"), ("dtype", None), ("device", None),
                       ("max_batch_size", "largest decode batch timed (powers of two up to it), and the calibration "
                        f"run's batch; smaller than serve's ({SchedulerConfig.max_batch_size}) to keep profiling "
                        "short: the fitted linear model predicts larger batches too"),
                       ("max_context", "longest context measured (default: the model's, at most 1024)"),
                       ("max_tokens_per_step", None),
                       ("samples", "grid points to measure (default: the full grid)"),
                       ("repeats", "timings per point; the median is kept"), ("block_size", None), ("seed", None)):
        add_field_flag(p, ProfileOptions, name, help=text)
    add_field_flag(p, ProfileOptions, "tensor_parallel_size", "-tp",
                   help="GPUs to shard the model over; the profile records it (its name shows :tpN)")
    add_field_flag(p, ProfileOptions, "match_total", action=argparse.BooleanOptionalAction,
                   help="--from-trace: scale the fit so the traced steps add up to their wall time (the "
                   "engine's throughput, rare long stalls included); off: fit the typical step")
    add_field_flag(p, ProfileOptions, "with_grid", metavar="PROFILE",
                   help="--from-trace: fit the forward pass on this grid profile's timed batches too (a "
                   "`tokenslice profile` JSON), as heavy in all as the traced steps: a short trace holds few "
                   "large batches")
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
        write_json(a.out, result)
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
    parser = _Parser(prog="tokenslice", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="may be given several times")
    add_field_flag(g, SamplingParams, "max_tokens", default=GENERATE_MAX_TOKENS,
                   help=f"more than an API request's default ({SamplingParams.max_tokens}, OpenAI's), so that a "
                   "continuation is long enough to read")
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        add_field_flag(g, SamplingParams, name)
    g.add_argument("--stop", action="append")
    add_field_flag(g, SamplingParams, "ignore_eos")
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
    add_field_flag(s, ServerSettings, "max_waiting",
                   help="requests allowed to wait for their first token; more get 429 with Retry-After")
    add_field_flag(s, ServerSettings, "max_body_bytes", help="larger request bodies get 413")
    add_field_flag(s, ServerSettings, "engine_process", action=argparse.BooleanOptionalAction,
                   help="run the engine core in its own process, the default (HTTP work then never holds its "
                        "interpreter lock); --no-engine-process: on a thread of the server process")
    add_field_flag(s, CpuConfig, "api_server_cpus",
                   help="CPUs kept for the API server (HTTP, detokenization); the engine core gets the rest "
                        "(0: no split)")
    add_field_flag(s, CpuConfig, "engine_threads",
                   help="torch threads in the engine (default: one per engine CPU, or $OMP_NUM_THREADS)")
    add_field_flag(s, CpuConfig, "pin_cpus", action=argparse.BooleanOptionalAction,
                   help="bind the API server and the engine core to their own CPUs (Linux; default: only "
                        "with more than 2 CPUs)")
    s.set_defaults(func=cmd_serve)
    v = sub.add_parser("view", help="serve the live view's page over a `simulate --record-state` file, with a time slider")
    v.add_argument("file", help="JSON lines written by `tokenslice simulate --record-state`")
    v.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.set_defaults(func=cmd_view)
    add_simulation_subcommands(sub)
    add_bench_subcommand(sub)
    add_twin_subcommand(sub)
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
