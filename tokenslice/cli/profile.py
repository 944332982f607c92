"""`tokenslice profile`: time this machine (or fit step traces) into the simulator's cost model."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tokenslice.cli.args import add_field_flag
from tokenslice.config import SchedulerConfig


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


def add_subcommand(sub: Any) -> None:
    from tokenslice.sim.profile_options import ProfileOptions

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
