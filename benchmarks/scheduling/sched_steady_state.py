"""Scheduling benchmarks, part 1: the steady-state protocol (docs/DESIGN.md, "Benchmark protocols") on the
simulator. N = 8,000 ShareGPT (or Alpaca) requests, seeds 0 and 1, load as a fraction rho of fcfs's
saturation throughput on the same setup.

- the three target cells with all six policies: ShareGPT Gamma CV=4 at rho=0.8, ShareGPT Poisson
  at rho=0.9, Alpaca Gamma CV=4 at rho=0.9, with the targets marked PASS/MISS;
- the protocol grid rho = 0.6, 0.8, 0.95 x {Poisson, CV=4} for fcfs, skip-join-mlfq, srpt-oracle.

    nice -n 19 .venv/bin/python benchmarks/scheduling/sched_steady_state.py            # simulate, then print
    .venv/bin/python benchmarks/scheduling/sched_steady_state.py --report-only         # print from results/

Each configuration equals one `tokenslice simulate` call (printed with --commands). Results:
benchmarks/scheduling/results/sched_steady_*.json; figures: benchmarks/scheduling/figures/sched_steady_*.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.sim.simulate import run_sweep, sweep_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import (  # noqa: E402
    ALL_POLICIES, CACHE, CLI_DATASET, COST, save_figure, PROFILE, code_version, compact, fmt, log,
    make_spec, md_table, read_json, seed_mean, verdict, write_json)

GRID_POLICIES = ["fcfs", "skip-join-mlfq", "srpt-oracle"]
GRID_LOADS = [0.6, 0.8, 0.95]
SEEDS = [0, 1]

# name -> (workload, cv, loads, policies)
CONFIGS: dict[str, tuple[str, float, list[float], list[str]]] = {
    "cell_sharegpt_cv4_rho0.8": ("sharegpt", 4.0, [0.8], ALL_POLICIES),
    "cell_sharegpt_poisson_rho0.9": ("sharegpt", 1.0, [0.9], ALL_POLICIES),
    "cell_alpaca_cv4_rho0.9": ("alpaca", 4.0, [0.9], ALL_POLICIES),
    "grid_sharegpt_poisson": ("sharegpt", 1.0, GRID_LOADS, GRID_POLICIES),
    "grid_sharegpt_cv4": ("sharegpt", 4.0, GRID_LOADS, GRID_POLICIES),
}

# (cell, metric, policy, bound on policy/fcfs, reference value from the independent simulator)
TARGETS = [
    ("cell_sharegpt_cv4_rho0.8", "mean_normalized_latency", "skip-join-mlfq", 0.6, 0.55),
    ("cell_sharegpt_cv4_rho0.8", "mean_normalized_latency", "srpt-oracle", 0.3, 0.25),
    ("cell_sharegpt_cv4_rho0.8", "mean_ttft", "skip-join-mlfq", 0.05, 0.006),
    ("cell_sharegpt_cv4_rho0.8", "p95_normalized_latency", "skip-join-mlfq", 1.0, None),
    ("cell_sharegpt_poisson_rho0.9", "mean_normalized_latency", "skip-join-mlfq", 0.8, 0.77),
    ("cell_sharegpt_poisson_rho0.9", "mean_ttft", "skip-join-mlfq", 0.05, 0.02),
    ("cell_alpaca_cv4_rho0.9", "mean_normalized_latency", "skip-join-mlfq", 0.4, 0.33),
]

COLUMNS = [("mean norm s/tok", "mean_normalized_latency", 1.0), ("p95 norm s/tok", "p95_normalized_latency", 1.0),
           ("mean TTFT s", "mean_ttft", 1.0), ("p99 TTFT s", "p99_ttft", 1.0), ("p99.9 TBT ms", "p999_tbt", 1e3)]


def file_name(config: str, n: int) -> str:
    return f"sched_steady_{config}_n{n}.json"


def cli_command(config: str, n: int) -> str:
    workload, cv, loads, policies = CONFIGS[config]
    return (f"nice -n 19 .venv/bin/tokenslice simulate --profile {PROFILE} {CLI_DATASET[workload]} "
            f"--policy {','.join(policies)} --loads {','.join(map(str, loads))} --cv {cv:g} --seeds 0,1 "
            f"--num-requests {n} --max-batch-size 16")


def simulate(config: str, n: int) -> dict[str, Any]:
    workload, cv, loads, policies = CONFIGS[config]
    spec = make_spec(workload, policies=policies, loads=loads, cv=cv, seeds=SEEDS, num_requests=n)
    log(f"{config}: {sweep_size(spec)} simulations, N={n}")
    stamps: list[tuple[str, float]] = []
    last = [time.perf_counter()]

    def tick(desc: str) -> None:
        now = time.perf_counter()
        stamps.append((desc, now - last[0]))
        last[0] = now
        log(f"  {desc}: {stamps[-1][1]:.1f} s wall")

    t0 = time.perf_counter()
    res = compact(run_sweep(COST, spec, profile_name=PROFILE, cache=CACHE, progress=tick))
    # run_sweep ticks once per saturation run (one per seed), then once per run, in run order.
    for run, (_desc, wall) in zip(res["runs"], stamps[len(SEEDS):], strict=True):
        run["metrics"]["sim_wall_s"] = wall
    res["benchmark"] = {"config": config, "command": cli_command(config, n), "wall_s": time.perf_counter() - t0,
                        "saturation_wall_s": [w for _, w in stamps[:len(SEEDS)]], "code": code_version(),
                        "date": time.strftime("%Y-%m-%d")}
    write_json(file_name(config, n), res)
    return res


# ---------------------------------------------------------------- tables

def point_runs(res: Mapping[str, Any], policy: str, load: float) -> list[Mapping[str, Any]]:
    return sorted((r for r in res["runs"] if r["policy"] == policy and abs(r["load"] - load) < 1e-9),
                  key=lambda r: r["seed"])


def ratio_detail(res: Mapping[str, Any], policy: str, base: str, load: float, metric: str
                 ) -> tuple[float | None, list[float | None]]:
    """(ratio of the seed means, per-seed ratios) of policy vs base on one metric."""
    mine, mine_s = seed_mean(point_runs(res, policy, load), metric)
    theirs, theirs_s = seed_mean(point_runs(res, base, load), metric)
    if mine is None or not theirs:
        return None, []
    return mine / theirs, [a / b if a is not None and b else None for a, b in zip(mine_s, theirs_s)]


def policy_table(res: Mapping[str, Any], loads: Sequence[float], policies: Sequence[str]) -> str:
    rows = []
    for load in loads:
        for p in policies:
            runs = point_runs(res, p, load)
            row: list[Any] = [f"{load:g}", p]
            for _, key, scale in COLUMNS:
                m, vals = seed_mean(runs, key)
                row.append(f"{fmt(m * scale if m is not None else None)} "
                           f"({', '.join(fmt(v * scale if v is not None else None, 3) for v in vals)})")
            r_f, _ = ratio_detail(res, p, "fcfs", load, "mean_normalized_latency")
            r_s, _ = ratio_detail(res, p, "srpt-oracle", load, "mean_normalized_latency")
            t_f, _ = ratio_detail(res, p, "fcfs", load, "mean_ttft")
            tput, _ = seed_mean(runs, "throughput_rps")
            pre, _ = seed_mean(runs, "preemptions")
            wall, _ = seed_mean(runs, "sim_wall_s")
            row += [fmt(r_f, 3), fmt(r_s, 3), fmt(t_f, 3), fmt(tput), fmt(pre, 3), fmt(wall, 3)]
            rows.append(row)
    header = ["rho", "policy"] + [f"{c[0]} mean (s0, s1)" for c in COLUMNS] + \
             ["norm vs fcfs", "norm vs srpt", "TTFT vs fcfs", "tput req/s", "preemptions", "sim wall s"]
    return md_table(header, rows)


def saturation_line(res: Mapping[str, Any]) -> str:
    s = res["summary"]
    by_seed = ", ".join(f"seed {k}: {v:.4g}" for k, v in s["fcfs_saturation_rps_by_seed"].items())
    loads = sorted({r["load"] for r in res["runs"]})
    rates = {ld: sorted({r["rate"] for r in res["runs"] if abs(r["load"] - ld) < 1e-9}) for ld in loads}
    rate_txt = "; ".join(f"rho {ld:g} -> {', '.join(f'{x:.4g}' for x in rs)} req/s" for ld, rs in rates.items())
    return (f"fcfs saturation {s['fcfs_saturation_rps']:.4g} req/s ({by_seed}); {rate_txt}; "
            f"SLO {res['slo']['mean_normalized_latency']:.4g} s/token; KV blocks "
            f"{res['workload']['scheduler']['kv_cache_blocks']} (ample)")


def target_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for cell, metric, policy, bound, ref in TARGETS:
        if cell not in results:
            continue
        res = results[cell]
        load = CONFIGS[cell][2][0]
        r, per_seed = ratio_detail(res, policy, "fcfs", load, metric)
        rows.append([cell, policy, metric, f"<= {bound:g}", fmt(ref, 3) if ref is not None else "-",
                     fmt(r, 3), ", ".join(fmt(x, 3) for x in per_seed), verdict(r, bound)])
    return md_table(["cell", "policy", "metric", "target (x fcfs)", "reference", "ours (seed means)",
                     "per seed (s0, s1)", ""], rows)


# ---------------------------------------------------------------- figures

def plot_grid(results: Mapping[str, Mapping[str, Any]], n: int) -> str | None:
    grids = [c for c in ("grid_sharegpt_poisson", "grid_sharegpt_cv4") if c in results]
    if not grids:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("mean_normalized_latency", "mean normalized latency (s/token)", 1.0),
               ("p95_normalized_latency", "p95 normalized latency (s/token)", 1.0),
               ("mean_ttft", "mean TTFT (s)", 1.0), ("p999_tbt", "p99.9 TBT (ms)", 1e3)]
    fig, axes = plt.subplots(len(metrics), len(grids), figsize=(5.2 * len(grids), 3.0 * len(metrics)), squeeze=False)
    for j, cfg in enumerate(grids):
        res = results[cfg]
        for i, (key, label, scale) in enumerate(metrics):
            ax = axes[i][j]
            for k, p in enumerate(GRID_POLICIES):
                ys = [seed_mean(point_runs(res, p, ld), key)[0] for ld in GRID_LOADS]
                ax.plot(GRID_LOADS, [y * scale for y in ys], "o-", color=f"C{k}", label=p)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylabel(label, fontsize=8)
            if i == 0:
                ax.set_title(("Poisson" if "poisson" in cfg else "Gamma CV=4") + f", ShareGPT, N={n}, seeds 0,1")
                ax.legend(fontsize=8)
            if i == len(metrics) - 1:
                ax.set_xlabel("load rho (fraction of fcfs saturation)")
    fig.suptitle(f"Steady-state protocol on the simulator ({PROFILE}, batch 16, ample KV)", fontsize=10)
    return save_figure(fig, "sched_steady_grid.png")


def plot_cells(results: Mapping[str, Mapping[str, Any]], n: int) -> str | None:
    cells = [c for c in CONFIGS if c.startswith("cell_") and c in results]
    if not cells:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(cells)
    for ax, (key, label) in zip(axes[:2], (("mean_normalized_latency", "mean normalized latency / fcfs's"),
                                           ("mean_ttft", "mean TTFT / fcfs's"))):
        for i, cell in enumerate(cells):
            load = CONFIGS[cell][2][0]
            ratios = [ratio_detail(results[cell], p, "fcfs", load, key)[0] for p in ALL_POLICIES]
            ax.bar(np.arange(len(ALL_POLICIES)) + (i - (len(cells) - 1) / 2) * width, ratios, width,
                   label=cell.removeprefix("cell_"), color=f"C{i}")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(ALL_POLICIES)), ALL_POLICIES, rotation=25, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    cell = "cell_sharegpt_cv4_rho0.8"
    if cell in results:
        for k, p in enumerate(ALL_POLICIES):
            cdfs = [r["tbt_cdf"] for r in point_runs(results[cell], p, 0.8) if r.get("tbt_cdf", {}).get("v")]
            if not cdfs:
                continue
            v = np.mean([c["v"] for c in cdfs], axis=0)
            tail = 1.0 - np.asarray(cdfs[0]["q"], dtype=float)
            keep = tail > 0
            ax.plot(np.maximum(v[keep], 1e-9) * 1e3, tail[keep], color=f"C{k}", label=p)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("TBT (ms)")
        ax.set_ylabel("1 - CDF (pooled gaps, quantiles averaged over seeds)")
        ax.set_title("TBT tail, ShareGPT CV=4 rho=0.8", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Steady-state cells, all six policies, N={n}, seeds 0,1 ({PROFILE}, batch 16)", fontsize=10)
    return save_figure(fig, "sched_steady_cells.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=8000)
    ap.add_argument("--only", default=None, help="comma-separated configs: " + ", ".join(CONFIGS))
    ap.add_argument("--report-only", action="store_true", help="print tables/figures from existing results")
    ap.add_argument("--commands", action="store_true", help="print the equivalent CLI commands and exit")
    a = ap.parse_args()
    n = a.num_requests
    names = a.only.split(",") if a.only else list(CONFIGS)
    if a.commands:
        for c in names:
            print(f"# {c}\n{cli_command(c, n)}")
        return
    results: dict[str, dict[str, Any]] = {}
    for c in names:
        if a.report_only:
            try:
                results[c] = read_json(file_name(c, n))
            except FileNotFoundError:
                log(f"no results for {c} (N={n}); skipped")
        else:
            results[c] = simulate(c, n)
    print(f"# Steady-state protocol, N = {n}, seeds {SEEDS}, profile {PROFILE}, batch 16, ample KV\n")
    print("## Targets (ratios vs fcfs at equal rho; ratio of the seed means, then each seed's own ratio)\n")
    print(target_table(results) + "\n")
    for c, res in results.items():
        b = res.get("benchmark", {})
        print(f"## {c}\n\ncommand: {b.get('command')}\n{saturation_line(res)}\n"
              f"wall: {fmt(b.get('wall_s'), 3)} s for {len(res['runs'])} runs + {len(SEEDS)} saturation runs; "
              f"code {b.get('code', {}).get('head')}\n")
        _, _, loads, policies = CONFIGS[c]
        print(policy_table(res, loads, policies) + "\n")
    for fig in (plot_grid(results, n), plot_cells(results, n)):
        if fig:
            log(f"wrote {fig}")


if __name__ == "__main__":
    main()
