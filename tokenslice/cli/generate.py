"""`tokenslice generate`: text for one or more prompts, offline, on an engine in this process."""
from __future__ import annotations

import argparse
from typing import Any

from tokenslice.cli.args import add_engine_args, add_field_flag, engine_config_from_args
from tokenslice.request import SamplingParams

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


def add_subcommand(sub: Any) -> None:
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
