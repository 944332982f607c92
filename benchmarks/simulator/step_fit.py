"""The cost model fitted on real step traces, checked per step on a held-out run.

For ../shared/models/stories260k and the 56M-parameter Llama of benchmarks/common/llama56m.py (both fp32 on this
CPU, one PyTorch thread), the real engine replays two Alpaca-shaped Poisson workloads with
`--step-trace`: one to fit on (fcfs, seed 0) and one held out (skip-join-mlfq, seed 1, another
policy so the batches differ). `tokenslice profile --from-trace` fits on the first (matching the
traced total time, the default, and the typical step, --no-match-total); the script prints the
per-step |predicted - actual| / actual of the step's wall time on the second, overall and by step
kind, and the same for the synthetic-grid profile (`tokenslice profile`, measured in the same run)
for comparison.

    PYTHONPATH=. .venv/bin/python benchmarks/simulator/step_fit.py [--out benchmarks/simulator/results/step_fit.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.workloads import make_workload
from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.replay import replay
from tokenslice.sim.profile_options import ProfileOptions
from tokenslice.sim.profiler import profile_from_traces, run_profile
from tokenslice.sim.trace_fit import describe_errors, evaluate_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import build_checkpoint  # noqa: E402

SHARED = Path(__file__).resolve().parents[3] / "shared"
STORIES = SHARED / "models" / "stories260k"
BATCH = 16
CACHE = DatasetCache()


@dataclasses.dataclass(frozen=True)
class Setup:
    """One model and the load it is traced under (rates are ~half the model's capacity here)."""

    name: str
    requests: int
    rate: float  # requests per second, Poisson
    max_output: int  # output tokens cap: keeps the slow model's run short
    grid: dict  # ProfileOptions changes for the synthetic-grid profile


def workload(setup: Setup, seed: int) -> list:
    reqs = make_workload("alpaca", num_requests=setup.requests, rate=setup.rate, cv=1.0, seed=seed,
                         dataset=SHARED / "data" / "alpaca_4500.json", tokenizer=SHARED / "tokenizers" / "gpt2",
                         length_filter=True, max_prompt_len=256, max_tokens_cap=setup.max_output, cache=CACHE)
    # Prompts as token ids of the stated length (outputs run to their length with ignore_eos).
    return [dataclasses.replace(r, prompt=None,
                                prompt_token_ids=[1] + [100 + (i % 300) for i in range(r.prompt_len - 1)])
            for r in reqs]


def record(model: Path, setup: Setup, policy: str, seed: int, path: Path) -> float:
    """Replay the workload on the real engine with a step trace; returns the run's seconds."""
    cfg = EngineConfig(model=ModelConfig(model=str(model), dtype="float32"),
                       cache=CacheConfig(kv_cache_blocks=setup.requests * 512 // 16),
                       scheduler=SchedulerConfig(policy=policy, max_batch_size=BATCH), step_trace=str(path))
    engine = Engine.from_config(cfg)
    try:
        t = time.perf_counter()
        replay(engine, workload(setup, seed))
        return time.perf_counter() - t
    finally:
        engine.close()


def run_model(model: Path, setup: Setup, work: Path, grid: bool) -> dict:
    fit_trace, held_trace = work / f"{setup.name}.fit.jsonl", work / f"{setup.name}.held.jsonl"
    for path in (fit_trace, held_trace):
        path.unlink(missing_ok=True)  # a trace file is appended to
    fit_s = record(model, setup, "fcfs", 0, fit_trace)
    held_s = record(model, setup, "skip-join-mlfq", 1, held_trace)
    opts = ProfileOptions(model=str(model), dtype="float32", max_batch_size=BATCH, repeats=3)
    out = {"model": setup.name, "fit_run_s": fit_s, "held_run_s": held_s}
    for match_total in (True, False):
        cost = profile_from_traces(dataclasses.replace(opts, match_total=match_total), [fit_trace])
        errors = evaluate_trace(cost, held_trace)
        key = "trace_fit" if match_total else "trace_fit_typical"
        out[key] = {"profile": cost.to_dict(), "errors": {k: dataclasses.asdict(v) for k, v in errors.items()}}
        own = evaluate_trace(cost, fit_trace)["all"]
        out[key]["errors_on_fit_trace"] = dataclasses.asdict(own)
        if match_total:
            loop = ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in cost.loop.items())
            print(f"\n== {setup.name}: fitted on {cost.samples} steps ({fit_s:.0f} s run), held out "
                  f"{held_s:.0f} s run; loop per step: {loop}")
        print(f"(on its own trace: median {own.median:.1%}, p90 {own.p90:.1%}, total {own.total:+.1%})")
        print(f"profile --from-trace{'' if match_total else ' --no-match-total'}, on the held-out trace:")
        print(describe_errors(errors))
    if grid:
        t = time.perf_counter()
        report = run_profile(dataclasses.replace(opts, **setup.grid))
        errors = evaluate_trace(report.cost, held_trace)
        out["grid"] = {"profile": report.cost.to_dict(),
                       "errors": {k: dataclasses.asdict(v) for k, v in errors.items()}}
        print(f"synthetic-grid profile ({time.perf_counter() - t:.0f} s to measure), on the same trace:")
        print(describe_errors(errors))
    return out


SETUPS = {
    "stories260k": Setup("stories260k", requests=300, rate=50.0, max_output=255,
                         grid={"max_context": 512}),
    "llama-56m": Setup("llama-56m", requests=40, rate=1.0, max_output=64,
                       grid={"max_context": 320, "samples": 24, "repeats": 2}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every workload's request count")
    ap.add_argument("--no-grid", action="store_true", help="skip the synthetic-grid profile comparison")
    ap.add_argument("--out", default=None, help="write the numbers as JSON")
    ap.add_argument("--traces", default=None, help="keep the step traces in this directory")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as the scheduling benchmarks: immune to a busy neighbour's barriers
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.traces or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            setup = dataclasses.replace(SETUPS[name], requests=max(8, round(SETUPS[name].requests * args.scale)))
            model = STORIES if name == "stories260k" else Path(tmp) / "llama-56m"
            if name == "llama-56m":
                build_checkpoint(model)
            results.append(run_model(model, setup, work, not args.no_grid))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
