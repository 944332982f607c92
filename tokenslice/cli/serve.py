"""`tokenslice serve`: the OpenAI-compatible HTTP server over one engine."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from tokenslice.cli.args import add_engine_args, add_field_flag, engine_config_from_args
from tokenslice.cli.serve_options import (add_server_options, check_port_free, resolve_model_tag, server_settings,
                                          uvicorn_options)
from tokenslice.cli.vllm_flags import add_vllm_compat_flags, log_vllm_notes
from tokenslice.config import CpuConfig, EngineConfig, ModelConfig
from tokenslice.model.known_models import check_model_source, check_tokenizer_source, resolve_model
from tokenslice.server.settings import ServerSettings

log = logging.getLogger("tokenslice.cli.serve")

# After the engine's death, open connections get this long to finish (their streams already
# got their error) before the server stops: `serve` then exits non-zero within a few seconds.
DEAD_ENGINE_GRACE_S = 1.0


def serve_engine_config(a: argparse.Namespace) -> EngineConfig:
    """`serve`'s engine: the flags, with compiled decode on unless --no-compile (ModelConfig.compile),
    built in the background unless --no-compile-in-background."""
    config = engine_config_from_args(a)
    if config.model.compile is None:
        config.model.compile = True
    if config.model.compile_in_background is None:
        config.model.compile_in_background = True
    return config


def serve_app_from_args(a: argparse.Namespace) -> Any:
    """The FastAPI app `serve` runs (tests start it the same way). With --engine-process (the
    default) the engine core starts here, in its own process, and is ready when this returns."""
    from tokenslice.server.identity import load_keyring
    from tokenslice.server.vllm_metrics import cache_info_labels

    resolve_model_tag(a)
    log_vllm_notes(a)
    settings = server_settings(a)
    config = serve_engine_config(a)
    # --api-keys: who each key is (server/identity.py); vtc then weighs tenants as the file says.
    settings.api_keys, settings.metrics_require_key = a.api_keys, a.metrics_require_key
    keyring = load_keyring(settings.api_keys, settings.api_key)
    if settings.metrics_require_key and not keyring.required:
        raise ValueError("--metrics-require-key needs --api-key or --api-keys")
    config.scheduler.tenant_weights = keyring.tenant_weights()
    settings.cache_config_info = cache_info_labels(config.cache)
    engine: Any
    if config.parallel.data_parallel_size > 1:
        if not settings.engine_process:
            raise ValueError("--data-parallel-size runs each engine in its own process: drop --no-engine-process")
        from tokenslice.engine.dp_client import DataParallelClient

        warming = warm_api_server(config)
        engine = DataParallelClient(config, max_waiting=settings.max_waiting,
                                    log_level=logging.getLogger().getEffectiveLevel(),
                                    cpus=replica_cpu_plans(a, config.parallel.data_parallel_size))
        warming.join()
    elif settings.engine_process:
        from tokenslice.engine.core_client import EngineCoreClient

        warming = warm_api_server(config)
        engine = EngineCoreClient(config, max_waiting=settings.max_waiting,
                                  log_level=logging.getLogger().getEffectiveLevel(), cpus=cpu_plan_from_args(a))
        warming.join()
    else:
        from tokenslice.engine.async_engine import AsyncEngine
        from tokenslice.engine.engine import Engine

        engine = AsyncEngine(Engine.from_config(config), max_waiting=settings.max_waiting)
    from tokenslice.server.app import create_app

    return create_app(engine, settings)


def warm_api_server(config: EngineConfig) -> threading.Thread:
    """While the engine core starts (its own process, on the other CPUs), import the HTTP server's
    modules and load the tokenizer once (transformers' imports), all of which would otherwise
    wait until the core is ready: seconds of start-up on 2 CPUs (benchmarks/startup)."""
    def warm() -> None:
        try:
            import tokenslice.server.app  # noqa: F401
            from tokenslice.model.loader import load_tokenizer

            load_tokenizer(config.model.tokenizer or config.model.model)
        except Exception:  # the engine's own start reports what is wrong
            log.debug("warming the API server's imports failed", exc_info=True)

    thread = threading.Thread(target=warm, name="tokenslice-warm-api", daemon=True)
    thread.start()
    return thread


def cpu_plan_from_args(a: argparse.Namespace) -> Any:
    """The serve flags' CPU split (engine/cpus.py CpuPlan)."""
    from tokenslice.engine.cpus import plan_cpus

    return plan_cpus(CpuConfig(a.api_server_cpus, a.engine_threads, a.pin_cpus))


def replica_cpu_plans(a: argparse.Namespace, replicas: int) -> list[Any]:
    """Each data-parallel replica's CPUs: the engine CPUs of the serve split dealt out in equal
    shares (pinned as the split is), or all of them shared where there are fewer than replicas."""
    from tokenslice.engine.cpus import CpuPlan

    plan = cpu_plan_from_args(a)
    cpus = plan.engine_cpus
    if len(cpus) < replicas:
        return [CpuPlan(plan.api_cpus, cpus, max(1, len(cpus) // replicas), False)] * replicas
    share = len(cpus) // replicas
    return [CpuPlan(plan.api_cpus, cpus[i * share:(i + 1) * share], share, plan.pin) for i in range(replicas)]


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


def check_before_loading(a: argparse.Namespace) -> None:
    """What would otherwise fail only once the model loaded (a busy port) or deep inside the load
    (transformers' errors, a requantized GGUF file): the port, --model, --tokenizer and
    --quantization. ModelLoadError or ValueError (exit code 2) names the flag."""
    check_port_free(a.host, a.port)
    resolve_model_tag(a)
    check_model_source(a.model)
    if a.tokenizer:
        check_tokenizer_source(a.tokenizer)
    path = Path(resolve_model(a.model))
    if a.quantization not in ("auto", "none") and path.suffix.lower() == ".gguf":
        from tokenslice.model.gguf import check_requantization, open_gguf  # torch: only for this check

        check_requantization(open_gguf(path), path, a.quantization)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from tokenslice.engine.core_client import EngineStartupError

    options = uvicorn_options(a)  # checked before the engine starts
    check_before_loading(a)
    try:
        app = serve_app_from_args(a)
    except EngineStartupError as e:  # as main() answers the same errors raised in this process
        print(f"error: {e}", file=sys.stderr)
        return 2
    claim_server_cpus(a)
    # Our own log line per request replaces uvicorn's access log (which would add nothing).
    server = uvicorn.Server(uvicorn.Config(app, **options, access_log=False, timeout_graceful_shutdown=5))
    died = False

    def on_dead() -> None:
        # A dead engine cannot come back: stop, and exit non-zero so that a supervisor restarts us.
        nonlocal died
        died = True
        server.config.timeout_graceful_shutdown = DEAD_ENGINE_GRACE_S
        server.should_exit = True

    app.state.server.async_engine.on_dead = on_dead
    server.run()
    if died:
        print("error: the engine died; the server stopped", file=sys.stderr)
        return 1
    return 0


def add_subcommand(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("TOKENSLICE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENSLICE_API_KEY); "
                        "/health and /metrics stay open")
    s.add_argument("--api-keys", metavar="FILE", default=None,
                   help="tenants and their API keys (TOML, or JSON if FILE ends in .json): each tenant's vtc "
                        "weight, allowed priority range, limits (max_in_flight, tokens_per_minute) and admin "
                        "flag; a tenant sees and re-prioritises only its own requests (README: API keys)")
    add_field_flag(s, ServerSettings, "metrics_require_key",
                   help="/metrics needs an admin key (an --api-keys admin, or --api-key)")
    add_field_flag(s, ServerSettings, "max_waiting",
                   help="requests allowed to wait for their first token; more get 429 with Retry-After")
    add_field_flag(s, ServerSettings, "max_body_bytes", help="larger request bodies get 413")
    add_field_flag(s, ServerSettings, "max_prompts_per_request",
                   help="most prompts in one completions request (a list of prompts); more get 400. Every "
                        "prompt x n is an engine request, counted against --max-waiting and the tenant's limits "
                        "before any is admitted")
    add_field_flag(s, ServerSettings, "request_read_timeout_s",
                   help="seconds a client may take to send a request's headers, and again its body; a slower "
                        "connection is closed (a slow body gets 408)")
    add_field_flag(s, ServerSettings, "max_connections_per_client",
                   help="open connections per client address; more are answered 503 and closed (0: no bound)")
    add_field_flag(s, ModelConfig, "compile_in_background", action=argparse.BooleanOptionalAction,
                   help="CPU: serve at once with eager decode steps and swap compiled ones in as they are built "
                        "(the default; /v1/state's compiled_decode says when); --no-compile-in-background: "
                        "build them before serving")
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
    add_server_options(s)
    add_vllm_compat_flags(s)
    s.set_defaults(func=cmd_serve)
