"""`tokenslice simulate`: policies x rates (or loads) on the simulator, with a cost model."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tokenslice.cli.args import (add_field_flag, add_priority_flags, add_scheduler_tuning_args, number_list, policy_list,
                                 write_json)
from tokenslice.config import SchedulerConfig
from tokenslice.sched.registry import POLICY_NAMES


def cmd_simulate(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenslice.bench.report import format_summary, format_table, plot_results
    from tokenslice.sim.simulate import SweepSpec, run_sweep, strip_per_request, sweep_size
    from tokenslice.predict.cost import load_cost_model

    cost = load_cost_model(a.profile)
    # Flags named like SweepSpec fields map onto them; the lists are parsed here.
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(SweepSpec) if hasattr(a, f.name)}
    spec = SweepSpec(**{**given, "policies": policy_list(a.policy),
                        "rates": number_list(a.rates) if a.rates else None,
                        "loads": number_list(a.loads) if a.loads else None,
                        "seeds": number_list(a.seeds, int) if a.seeds else [a.seed]})
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


def add_subcommand(sub: Any) -> None:
    from tokenslice.sim.simulate import HOST_KV_FACTOR, SweepSpec
    from tokenslice.bench.workloads import WORKLOAD_NAMES

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
         "benchmarks' batch (docs/benchmarks/scheduling-simulated.md), small enough that the queue builds and the order matters")
    flag("max_tokens_per_step")
    flag("kv_cache_blocks", help="device KV blocks (default: ample, every request of the workload fits at once)")
    flag("host_kv_blocks", help=f"host KV blocks for the swap modes (default: {HOST_KV_FACTOR}x the device pool)")
    flag("offload_dtype")
    flag("enable_prefix_caching", action=argparse.BooleanOptionalAction,
         help="share cached KV of equal prompt prefixes (dataset workloads: synthetic prompts never share)")
    flag("block_groups", action=argparse.BooleanOptionalAction,
         help="swap modes: few contiguous runs per request (FastSwitch); off: one copy per block as vLLM")
    flag("async_scheduling", action=argparse.BooleanOptionalAction,
         help="time steps as the engine's --async-scheduling does: the loop's own time (profiles with loop "
              "terms) overlaps the step's instead of adding to it")
    add_scheduler_tuning_args(m, SweepSpec)
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
