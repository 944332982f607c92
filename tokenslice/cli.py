"""The `tokenslice` command. Each subcommand lives in a function `cmd_<name>`; flags are the
kebab-case names of config fields (DESIGN.md)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, PREEMPTION_MODES


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
    p.add_argument("--swap-space-gb", type=float, default=0.0)
    p.add_argument("--offload-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--preemption", default="recompute", choices=list(PREEMPTION_MODES))
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-tokens-per-step", type=int, default=2048)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device,
                          max_model_len=a.max_model_len, seed=a.seed),
        cache=CacheConfig(block_size=a.block_size, kv_cache_blocks=a.kv_cache_blocks,
                          kv_memory_fraction=a.kv_memory_fraction, swap_space_gb=a.swap_space_gb,
                          offload_dtype=a.offload_dtype),
        scheduler=SchedulerConfig(policy=a.policy, preemption=a.preemption, max_batch_size=a.max_batch_size,
                                  max_tokens_per_step=a.max_tokens_per_step))


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
