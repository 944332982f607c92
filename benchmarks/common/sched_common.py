"""Shared setup of the simulated scheduling and KV benchmarks (benchmarks/scheduling/ and
benchmarks/kv/): the common setup, a memoizing runner built on tokenslice.sim.simulate, compact
results files, and small table helpers. Results and figures go to the running script's topic
folder (benchmarks/<topic>/results/ and figures/).

Common setup: profile opt-13b@a100-40gb, max batch size 16, ample KV (the simulate default),
recompute preemption (the simulate default; memory never binds so it never triggers), datasets
through vLLM's length filter.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.metrics import SLO, max_rate_detail, results_file
from tokenslice.sim.simulate import SweepSpec, ample_kv_blocks, fcfs_saturation_rps, per_request_data, \
    run_metrics, simulate_run, summary_for
from tokenslice.bench.datasets import DatasetCache
from tokenslice.predict.cost import CostModel, load_cost_model
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import make_policy

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PROFILE = "opt-13b@a100-40gb"
ALL_POLICIES = ["fcfs", "request-level", "mlfq", "fixed-priority", "skip-join-mlfq", "srpt-oracle"]
DATASETS = {
    "sharegpt": dict(dataset=str(SHARED / "data" / "sharegpt_multiturn_800.json"),
                     tokenizer=str(SHARED / "tokenizers" / "gpt2"), length_filter=True),
    "alpaca": dict(dataset=str(SHARED / "data" / "alpaca_4500.json"),
                   tokenizer=str(SHARED / "tokenizers" / "gpt2"), length_filter=True),
}
# The CLI spells the same datasets relative to the repository root.
CLI_DATASET = {
    "sharegpt": "--workload sharegpt --dataset ../shared/data/sharegpt_multiturn_800.json "
                "--tokenizer ../shared/tokenizers/gpt2 --length-filter",
    "alpaca": "--workload alpaca --dataset ../shared/data/alpaca_4500.json "
              "--tokenizer ../shared/tokenizers/gpt2 --length-filter",
}

COST = load_cost_model(PROFILE)
CACHE = DatasetCache()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def code_version() -> dict[str, Any]:
    """HEAD and whether tokenslice/ had uncommitted edits when the benchmark ran (others edit it
    concurrently; a result is only reproducible against the code that produced it)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    dirty = git("status", "--porcelain", "--", "tokenslice")
    return {"head": git("rev-parse", "--short", "HEAD"), "tokenslice_dirty": sorted(dirty.splitlines())}


def topic_dir() -> Path:
    """The running script's folder, benchmarks/<topic>/: its results/ and figures/ are there."""
    main = getattr(sys.modules["__main__"], "__file__", None)
    return Path(main).resolve().parent if main else ROOT / "benchmarks" / "scheduling"


def make_spec(workload: str, **kw: Any) -> SweepSpec:
    """A SweepSpec with the common setup; `kw` sets the rest (policies, rates/loads, ...)."""
    kw.setdefault("policies", ["fcfs"])
    if "rates" not in kw and "loads" not in kw:
        kw["loads"] = [1.0]
    return SweepSpec(workload=workload, max_batch_size=16, **DATASETS[workload], **kw)


class Runner:
    """Memoized single simulations with exactly run_sweep's steps (same workload streams, ample KV
    sized on the all-at-once workload of each seed, fcfs saturation per seed), so adaptive sweeps
    can add points without re-running any."""

    def __init__(self, spec: SweepSpec, cost: CostModel = COST) -> None:
        """`cost`: the profile (the common setup's by default); `spec.kv_cache_blocks` None: ample KV."""
        self.spec = spec
        self.cost = cost
        self.slo = spec.slo_normalized_latency or 10 * cost.min_iteration_seconds()
        for p in spec.policies:
            make_policy(p, PolicyContext(spec.scheduler_config(p, self.slo), cost))
        self.at_once = {s: spec.make(s, None, CACHE) for s in spec.seeds}
        self.kv_blocks = spec.kv_cache_blocks or max(ample_kv_blocks(w, spec.max_batch_size, spec.block_size)
                                                     for w in self.at_once.values())
        self._sat: dict[int, float] = {}
        self.runs: dict[tuple[str, float, int], dict[str, Any]] = {}
        self.wall: dict[tuple[str, float, int], float] = {}

    def set_saturation(self, seed: int, rps: float) -> None:
        """fcfs's saturation measured elsewhere on the same at-once workload (only the arrival
        process or the policy differs), e.g. in another process."""
        self._sat[seed] = rps

    def saturation(self, seed: int) -> float:
        if seed not in self._sat:
            self._sat[seed] = fcfs_saturation_rps(self.cost, self.at_once[seed],
                                                  self.spec.scheduler_config("fcfs", self.slo), self.kv_blocks,
                                                  self.spec.block_size)
        return self._sat[seed]

    def run(self, policy: str, rate: float, seed: int) -> dict[str, Any]:
        key = (policy, round(rate, 9), seed)
        if key not in self.runs:
            wl = self.spec.make(seed, rate, CACHE)
            t = time.perf_counter()
            records, counters = simulate_run(self.cost, wl, self.spec.scheduler_config(policy, self.slo),
                                             self.kv_blocks, self.spec.block_size, self.spec.host_kv_blocks)
            wall = time.perf_counter() - t
            metrics = run_metrics(records, counters, self.slo)
            metrics["sim_wall_s"] = wall
            sat = self.saturation(seed)
            self.runs[key] = {"policy": policy, "preemption": self.spec.preemption, "rate": rate,
                              "load": rate / sat, "cv": self.spec.cv, "num_requests": len(wl), "seed": seed,
                              "tbt_cdf": per_request_data(records)["tbt_cdf"], "metrics": metrics}
            self.wall[key] = wall
            log(f"  {policy:15s} rate={rate:.4g} seed={seed} N={len(wl)}: mean norm "
                f"{metrics['mean_normalized_latency']:.4g} s/tok, {wall:.1f} s wall")
        return self.runs[key]

    def results(self, extra_workload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A docs/DESIGN.md results file (rate sweep) over every run so far."""
        runs = [self.runs[k] for k in sorted(self.runs)]
        spec = SweepSpec(**{**self.spec.__dict__, "rates": sorted({r["rate"] for r in runs}), "loads": None})
        sat = {s: self.saturation(s) for s in spec.seeds}
        summary = summary_for(runs, spec, self.slo, sat)
        workload = {"name": spec.workload, "dataset": spec.dataset, "tokenizer": spec.tokenizer,
                    "num_requests": spec.num_requests, "cv": spec.cv, "seeds": list(spec.seeds), "sweep": "rate",
                    "rates": spec.rates, "io_ratio": spec.io_ratio, "length_filter": spec.length_filter,
                    "scheduler": {"preemption": spec.preemption, "max_batch_size": spec.max_batch_size,
                                  "max_tokens_per_step": spec.max_tokens_per_step, "kv_cache_blocks": self.kv_blocks,
                                  "block_size": spec.block_size}, **(extra_workload or {})}
        return results_file("simulate", workload, self.cost.name, SLO(mean_normalized_latency=self.slo), runs, summary)


def seed_mean(runs: Iterable[Mapping[str, Any]], metric: str) -> tuple[float | None, list[float | None]]:
    vals = [r["metrics"].get(metric) for r in runs]
    if not vals or any(v is None for v in vals):
        return None, vals
    return float(np.mean(vals)), vals


def max_rate(points: Sequence[tuple[float, float | None]], slo: float) -> tuple[float, bool, bool]:
    """(max rate under the SLO, censored, infeasible) from seed-averaged (rate, latency) points."""
    d = max_rate_detail([p[0] for p in points], [p[1] for p in points], slo)
    return d.rate, d.censored, getattr(d, "infeasible", False)


def compact(results: Mapping[str, Any]) -> dict[str, Any]:
    """A results file without per-request arrays (the TBT quantile CDF, 110 numbers, stays)."""
    out = dict(results)
    runs = []
    for run in results["runs"]:
        r = {k: v for k, v in run.items() if k != "per_request"}
        if "per_request" in run:
            r["tbt_cdf"] = run["per_request"]["tbt_cdf"]
        runs.append(r)
    out["runs"] = runs
    return out


def save_figure(fig: Any, name: str, dpi: int = 110) -> str:
    """Write a matplotlib figure under benchmarks/<topic>/figures/, close it, return its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    figures = topic_dir() / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    out = figures / name
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return str(out)


def write_json(name: str, data: Any) -> Path:
    """Write `name` under benchmarks/<topic>/results/; returns its path."""
    results = topic_dir() / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / name
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    log(f"wrote {path.relative_to(ROOT)}")
    return path


def read_json(name: str) -> Any:
    return json.loads((topic_dir() / "results" / name).read_text())


def fmt(v: float | None, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}g}"


def verdict(value: float | None, target: float, *, at_most: bool = True) -> str:
    if value is None:
        return "n/a"
    return "PASS" if (value <= target if at_most else value >= target) else "MISS"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


def machine_line() -> str:
    return f"machine: this 2-core CPU box ({os.cpu_count()} CPUs visible), simulator (virtual time), profile {PROFILE}"
