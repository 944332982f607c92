"""Simulator fidelity: the real engine over HTTP against its simulated twin, same traces.

For each model — ../shared/models/stories260k and the ~56M-parameter Llama of engine_vs_hf.py
(random weights, fp32; its step is long next to this box's timing noise) — `tokenslice twin`'s
machinery (tokenslice.bench.twin) profiles the model on this machine (`tokenslice profile`, one
thread, as the servers run), starts one `tokenslice serve` per policy (fcfs, skip-join-mlfq,
srpt-predicted; max batch 16, ample KV, step traces on), measures fcfs saturation over HTTP (all
requests at once), and replays the same Alpaca-shaped traces (GPT-2 token counts, vLLM's length
filter, prompts sent as token ids of each request's length, outputs forced to their length) at
Poisson rho = 0.3, 0.5, 0.7, 0.9 and Gamma CV = 4 rho = 0.8, `--repeats` times each on the real
server and once in the simulator with the profile and the measured serving path.

Reported: mean normalized latency and mean TTFT, real (mean over repeats, spread = largest
relative distance of a repeat from that mean) vs simulated, the error, and whether it meets the
target (10% at rho <= 0.7, 20% at rho = 0.9 and CV = 4, or within the real spread where that is
wider); and the per-step |error| of the profile's step time against every real step of those
runs (held out: the profile is fitted on its own synthetic grid, never on these traces).

N per run is fixed per model before any result (stories260k 200, the 56M Llama 40, times
--scale) so that one command fits ~15 minutes on a quiet 2-core box; the workload, N and seed are
never tuned to reach a target.

    .venv/bin/python benchmarks/sim_fidelity.py [--scale 1] [--repeats 2] [--out benchmarks/results/sim_fidelity.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from tokenslice.bench.trace_compare import steps_between
from tokenslice.bench.twin import TwinPoint, TwinSpec, run_twin
from tokenslice.bench.workloads import DatasetCache
from tokenslice.config import CacheConfig
from tokenslice.engine.step_trace import load_step_trace
from tokenslice.engine.trace_fit import evaluate_steps, traced_steps
from tokenslice.exec.sim import offload_block_bytes
from tokenslice.predict.cost import load_cost_model

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
POLICIES = ["fcfs", "skip-join-mlfq", "srpt-predicted"]
POINTS = [TwinPoint(load=x) for x in (0.3, 0.5, 0.7, 0.9)] + [TwinPoint(load=0.8, cv=4.0)]
# model name -> (requests per run, longest prompt, longest output): the 56M Llama's steps are
# ~20x stories260k's, so its requests are fewer and shorter to fit the time budget.
MODELS = {"stories260k": (200, 256, 255), "llama-56m": (40, 64, 32)}


def target(point: TwinPoint) -> float:
    """The issue's bound on |error|: 10% up to rho = 0.7 under Poisson, 20% beyond or bursty."""
    return 0.10 if point.cv == 1.0 and (point.load or 0.0) <= 0.7 else 0.20


def model_dir(name: str, tmp: Path) -> str:
    if name == "stories260k":
        return str(SHARED / "models" / "stories260k")
    from engine_vs_hf import build_checkpoint  # this directory is on sys.path when run as a script

    path = tmp / "llama-56m"
    build_checkpoint(path)
    return str(path)


def run_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    n, prompt_cap, output_cap = MODELS[name]
    traces = tmp / f"{name}-traces"
    spec = TwinSpec(model=model_dir(name, tmp), policies=args.policies.split(","), workload="alpaca",
                    load=1.0, num_requests=max(4, round(n * args.scale)), seed=args.seed, repeats=args.repeats,
                    dtype="float32", dataset=str(SHARED / "data"), tokenizer=str(SHARED / "tokenizers" / "gpt2"),
                    length_filter=True, max_prompt_len=prompt_cap, max_tokens_cap=output_cap, server_threads=1,
                    step_trace_dir=str(traces))
    t0 = time.perf_counter()
    result = run_twin(spec, progress=lambda m: print(f"  [{time.perf_counter() - t0:5.0f} s] {name}: {m}",
                                                      file=sys.stderr, flush=True),
                      cache=DatasetCache(), points=POINTS)
    result["elapsed_s"] = time.perf_counter() - t0
    # Per-step error (`profile --evaluate`'s) on every real step of the measured runs.
    cost = load_cost_model(result["profile_file"])
    measured = []
    for policy in spec.policies:
        steps = load_step_trace(traces / f"{policy}.steps.jsonl")
        for point in result["points"]:
            for a, b in point["policies"][policy]["windows"]:
                measured += traced_steps(steps_between(steps, a, b))
    stats = evaluate_steps(cost, measured, offload_block_bytes(CacheConfig.block_size, cost.kv_bytes_per_token))["all"]
    result["step_error"] = {"steps": stats.steps, "median_abs": stats.median, "p90_abs": stats.p90,
                            "mean_signed": stats.bias, "total": stats.total}
    result["profile_json"] = json.loads(Path(result["profile_file"]).read_text())
    return result


def verdict(m: dict[str, Any], bound: float) -> str:
    if m["error"] is None:
        return "-"
    allowed = max(bound, m["real_spread"] or 0.0)
    return "ok" if abs(m["error"]) <= allowed else "MISS"


def table(name: str, result: dict[str, Any]) -> str:
    se = result["step_error"]
    lines = [f"\n{name}: N = {result['num_requests']} per run, {result['spec']['repeats']} real runs per point, "
             f"fcfs saturation {result['saturation_rps']:.3g} req/s, {result['elapsed_s']:.0f} s",
             f"per-step |error| of the profile on {se['steps']} real steps: median {100 * se['median_abs']:.1f}%, "
             f"p90 {100 * se['p90_abs']:.1f}% (median signed {100 * se['mean_signed']:+.1f}%, summed time "
             f"{100 * se['total']:+.1f}%)",
             f"| point | policy | real norm. latency (spread) | simulated | error | | real TTFT (spread) | simulated "
             f"| error | |", "|---|---|---|---|---|---|---|---|---|---|"]
    for point in result["points"]:
        p = TwinPoint(**point["point"])
        for policy, data in point["policies"].items():
            cells = []
            for key in ("mean_normalized_latency", "mean_ttft"):
                m = data["metrics"][key]
                cells += [f"{m['real']:.4g} ({100 * (m['real_spread'] or 0):.0f}%)", f"{m['sim']:.4g}",
                          f"{100 * m['error']:+.1f}%", verdict(m, target(p))]
            lines.append(f"| {p.label()} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scale", type=float, default=1.0, help="requests per run, times each model's fixed N")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
        for name in args.models.split(","):
            results[name] = run_model(name, args, Path(tmp))
            print(table(name, results[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
