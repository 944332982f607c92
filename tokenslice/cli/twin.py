"""`tokenslice twin`: one arrival trace on the real engine over HTTP and in the simulator, compared."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from tokenslice.cli.args import add_field_flag, policy_list, write_json
from tokenslice.sched.registry import POLICY_NAMES


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


def add_subcommand(sub: Any) -> None:
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
    flag("port", help="the port of the servers twin starts, one at a time (default: a free port each)")
    flag("server_step_trace", metavar="FILE", help="with --url: the file the server's --step-trace writes "
         "(needed for the serving path and the step comparison)")
    flag("step_trace_dir", metavar="DIR", help="keep the servers' and the simulator's step traces here")
    flag("serving_path", action=argparse.BooleanOptionalAction,
         help="model the HTTP path (in and out, measured on lone requests) in the simulator")
    flag("warmup_requests", help="unrecorded requests sent to each server first")
    t.add_argument("--out", default=None, help="write the comparison as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress lines")
    t.set_defaults(func=cmd_twin)
