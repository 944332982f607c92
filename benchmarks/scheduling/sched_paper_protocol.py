"""Scheduling benchmarks, part 2: the paper protocol (docs/DESIGN.md, "Benchmark protocols") on the simulator.

A finite ShareGPT trace (N = 2,000 by default), Poisson arrivals, a rate sweep, and each policy's
max rate under the SLO (mean normalized latency <= 10x the profile's decode iteration time, the
simulate default), all six policies; a plot like FastServe Fig. 11. Then fcfs / skip-join-mlfq /
srpt-oracle again at N = 1,000 and 8,000 with the same sweep, to show how the ratios move with N.

The sweep: 0.5 ... 3.0 req/s in steps of 0.25 for every policy, extended down (0.25, 0.1, 0.05)
while a policy misses the SLO at its lowest point and up (+0.5) while it meets it at its highest;
then every policy's knee bracket is filled in at steps of 0.05 req/s. Seeds 0 and 1: latency is
averaged over the seeds at each rate before the max rate is interpolated (as `tokenslice simulate`
does); per-seed max rates are reported beside it.

    nice -n 19 .venv/bin/python benchmarks/scheduling/sched_paper_protocol.py              # N = 2,000, six policies
    nice -n 19 .venv/bin/python benchmarks/scheduling/sched_paper_protocol.py --vs-n       # N = 1,000 and 8,000
    .venv/bin/python benchmarks/scheduling/sched_paper_protocol.py --report-only           # print from results/
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import (  # noqa: E402
    ALL_POLICIES, CLI_DATASET, save_figure, PROFILE, Runner, code_version, fmt, log, make_spec,
    max_rate, md_table, read_json, verdict, write_json)


SEEDS = [0, 1]
COARSE = [round(0.5 + 0.25 * i, 4) for i in range(11)]  # 0.5 ... 3.0
LOW_EXTENSION = [0.25, 0.1, 0.05]
HIGH_STEP = 0.5
HIGH_LIMIT = 12.0
FINE_STEP = 0.05
VS_N_POLICIES = ["fcfs", "skip-join-mlfq", "srpt-oracle"]
TARGETS = [("srpt-oracle", 2.0, 2.3), ("skip-join-mlfq", 1.05, 1.10)]


def file_name(n: int) -> str:
    return f"sched_paper_n{n}.json"


def curve(runner: Runner, policy: str) -> list[tuple[float, float | None]]:
    """(rate, latency averaged over the seeds) for every rate simulated for every seed."""
    by_rate: dict[float, list[float]] = {}
    for (p, rate, _seed), run in runner.runs.items():
        if p == policy:
            by_rate.setdefault(rate, []).append(run["metrics"]["mean_normalized_latency"])
    return [(r, float(np.mean(v))) for r, v in sorted(by_rate.items()) if len(v) == len(runner.spec.seeds)]


def run_rates(runner: Runner, policy: str, rates: Sequence[float]) -> None:
    for r in rates:
        for s in runner.spec.seeds:
            runner.run(policy, r, s)


def sweep_policy(runner: Runner, policy: str) -> None:
    """Coarse grid, extend until the SLO is crossed inside the sweep, fill in the knee."""
    slo = runner.slo
    run_rates(runner, policy, COARSE)
    for low in LOW_EXTENSION:
        pts = curve(runner, policy)
        if pts[0][1] is not None and pts[0][1] <= slo:
            break
        run_rates(runner, policy, [low])
    while True:
        pts = curve(runner, policy)
        top = pts[-1][0]
        if pts[-1][1] is None or pts[-1][1] > slo or top >= HIGH_LIMIT:
            break
        run_rates(runner, policy, [round(top + HIGH_STEP, 4)])
    for _ in range(3):  # a fill-in can move the first crossing into a new bracket; rarely more than once
        pts = curve(runner, policy)
        _, censored, infeasible = max_rate(pts, slo)
        if censored or infeasible:
            return
        first_bad = next(i for i, (_, v) in enumerate(pts) if v is None or v > slo)
        r0, r1 = pts[first_bad - 1][0], pts[first_bad][0]
        step = FINE_STEP if r0 >= 0.5 else FINE_STEP / 5
        fill = [round(x, 4) for x in np.arange(r0 + step, r1 - step / 2, step)]
        new = [x for x in fill if (policy, round(x, 9), runner.spec.seeds[0]) not in runner.runs]
        if not new:
            return
        run_rates(runner, policy, new)


def max_rates(runner: Runner, policy: str) -> dict[str, Any]:
    rate, censored, infeasible = max_rate(curve(runner, policy), runner.slo)
    per_seed = []
    for s in runner.spec.seeds:
        pts = sorted((r, run["metrics"]["mean_normalized_latency"]) for (p, r, ss), run in runner.runs.items()
                     if p == policy and ss == s)
        per_seed.append(max_rate(pts, runner.slo)[0])
    return {"rate": rate, "censored": censored, "infeasible": infeasible, "per_seed": per_seed}


def simulate(n: int, policies: Sequence[str]) -> dict[str, Any]:
    spec = make_spec("sharegpt", policies=list(policies), rates=[1.0], cv=1.0, seeds=SEEDS, num_requests=n)
    runner = Runner(spec)
    t0 = time.perf_counter()
    sat = {s: runner.saturation(s) for s in SEEDS}
    log(f"N={n}: fcfs saturation {sat} req/s, SLO {runner.slo:.4g} s/token")
    for p in policies:
        sweep_policy(runner, p)
    res = runner.results()
    for run in res["runs"]:
        run.pop("tbt_cdf", None)  # no per-request data in these files
    summ = {p: max_rates(runner, p) for p in policies}
    res["benchmark"] = {"max_rate": summ, "wall_s": time.perf_counter() - t0, "code": code_version(),
                        "date": time.strftime("%Y-%m-%d"), "sweep_rule": __doc__.split("The sweep:")[1].split("\n\n")[0],
                        "command": cli_command(n, policies, sorted({r["rate"] for r in res["runs"]}))}
    write_json(file_name(n), res)
    return res


def cli_command(n: int, policies: Sequence[str], rates: Sequence[float]) -> str:
    return (f"nice -n 19 .venv/bin/tokenslice simulate --profile {PROFILE} {CLI_DATASET['sharegpt']} "
            f"--policy {','.join(policies)} --rates {','.join(f'{r:g}' for r in rates)} --seeds 0,1 "
            f"--num-requests {n} --max-batch-size 16   # (the script runs each policy only at its own rates)")


# ---------------------------------------------------------------- report

def points(res: Mapping[str, Any], policy: str) -> list[tuple[float, float]]:
    by_rate: dict[float, list[float]] = {}
    for r in res["runs"]:
        if r["policy"] == policy:
            by_rate.setdefault(r["rate"], []).append(r["metrics"]["mean_normalized_latency"])
    return [(x, float(np.mean(v))) for x, v in sorted(by_rate.items())]


def policies_of(res: Mapping[str, Any]) -> list[str]:
    present = {r["policy"] for r in res["runs"]}
    return [p for p in ALL_POLICIES if p in present]


def max_rate_table(res: Mapping[str, Any]) -> str:
    mr = res["benchmark"]["max_rate"]
    sat = res["summary"]["fcfs_saturation_rps"]
    base = mr.get("fcfs", {}).get("rate")
    base_seed = mr.get("fcfs", {}).get("per_seed", [])
    rows = []
    for p in policies_of(res):
        d = mr[p]
        mark = "+" if d["censored"] else ("(infeasible)" if d["infeasible"] else "")
        seeds = ", ".join(fmt(x, 3) for x in d["per_seed"])
        seed_ratio = ", ".join(fmt(x / b, 3) if b else "-" for x, b in zip(d["per_seed"], base_seed))
        walls = [r["metrics"].get("sim_wall_s", 0.0) for r in res["runs"] if r["policy"] == p]
        rows.append([p, f"{d['rate']:.3f}{mark}", fmt(d["rate"] / sat, 3), fmt(d["rate"] / base, 3) if base else "-",
                     seeds, seed_ratio, len(walls), f"{np.mean(walls):.2f} / {np.max(walls):.2f}"])
    return md_table(["policy", "max rate req/s", "/ fcfs saturation", "vs fcfs", "per seed (s0, s1)",
                     "per-seed vs fcfs", "runs", "sim wall s mean / max"], rows)


def target_table(res: Mapping[str, Any]) -> str:
    mr = res["benchmark"]["max_rate"]
    base = mr["fcfs"]["rate"]
    rows = []
    for p, bound, ref in TARGETS:
        if p in mr:
            r = mr[p]["rate"] / base if base else None
            rows.append([p, f">= {bound:g}", fmt(ref, 3), fmt(r, 3), verdict(r, bound, at_most=False)])
    return md_table(["policy", "target (max rate x fcfs)", "reference", "ours", ""], rows)


def curve_table(res: Mapping[str, Any]) -> str:
    pols = policies_of(res)
    pts = {p: dict(points(res, p)) for p in pols}
    rates = sorted({x for d in pts.values() for x in d})
    slo = res["slo"]["mean_normalized_latency"]
    rows = [[f"{x:g}"] + [(fmt(pts[p].get(x), 3) + ("*" if pts[p].get(x, 0) > slo else "")) if x in pts[p] else ""
                          for p in pols] for x in rates]
    return md_table(["rate req/s"] + pols, rows)


def vs_n_table(all_res: Mapping[int, Mapping[str, Any]]) -> str:
    rows = []
    for n, res in sorted(all_res.items()):
        mr = res["benchmark"]["max_rate"]
        base = mr["fcfs"]["rate"]
        sat = res["summary"]["fcfs_saturation_rps"]
        row = [n, fmt(sat, 4)]
        for p in VS_N_POLICIES:
            d = mr.get(p)
            row += [f"{d['rate']:.3f}{'+' if d['censored'] else ''}" if d else "-",
                    fmt(d["rate"] / base, 3) if d and base else "-"]
        rows.append(row)
    head = ["N", "fcfs saturation req/s"]
    for p in VS_N_POLICIES:
        head += [f"{p} max rate", f"{p} vs fcfs"]
    return md_table(head, rows)


def x_limit(res: Mapping[str, Any]) -> float:
    """Show the coarse sweep and every finite max rate with some room past it."""
    finite = [d["rate"] for d in res["benchmark"]["max_rate"].values() if not d["censored"]]
    return max([COARSE[-1]] + [1.2 * r for r in finite]) + 0.1


def plot_fig11(res: Mapping[str, Any], n: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = res["slo"]["mean_normalized_latency"]
    mr = res["benchmark"]["max_rate"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for k, p in enumerate(policies_of(res)):
        xs, ys = zip(*points(res, p))
        style = "x--" if p == "mlfq" else "o-"  # mlfq and skip-join nearly coincide on ShareGPT
        ax.plot(xs, ys, style, ms=3 if p != "mlfq" else 5, color=f"C{k}", label=f"{p} (max {mr[p]['rate']:.2f} req/s)")
        if not mr[p]["infeasible"]:
            ax.axvline(mr[p]["rate"], color=f"C{k}", linestyle=":", linewidth=0.8)
    ax.axhline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:.3g} s/token (10x decode step)")
    ax.axvline(res["summary"]["fcfs_saturation_rps"], color="grey", linewidth=2, alpha=0.3,
               label=f"fcfs saturation {res['summary']['fcfs_saturation_rps']:.2f} req/s")
    ax.set_yscale("log")
    ax.set_xlim(0, x_limit(res))
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title(f"Paper protocol (cf. FastServe Fig. 11): ShareGPT, Poisson, N={n}, seeds 0,1 averaged\n"
                 f"{PROFILE}, batch 16, ample KV", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, f"sched_paper_fig11_n{n}.png", dpi=120)


def plot_vs_n(all_res: Mapping[int, Mapping[str, Any]]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(all_res)
    fig, axes = plt.subplots(1, len(ns) + 1, figsize=(4.6 * (len(ns) + 1), 4.2))
    for ax, n in zip(axes, ns):
        res = all_res[n]
        slo = res["slo"]["mean_normalized_latency"]
        for k, p in enumerate(ALL_POLICIES):
            if p not in VS_N_POLICIES:
                continue
            xs, ys = zip(*points(res, p))
            ax.plot(xs, ys, "o-", ms=3, color=f"C{k}", label=p)
        ax.axhline(slo, color="k", linestyle="--", linewidth=1)
        ax.axvline(res["summary"]["fcfs_saturation_rps"], color="grey", linewidth=2, alpha=0.3)
        ax.set_yscale("log")
        ax.set_xlim(0, x_limit(res))
        ax.set_title(f"N = {n}", fontsize=9)
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean normalized latency (s/token)")
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    for k, p in enumerate(ALL_POLICIES):
        if p in VS_N_POLICIES and p != "fcfs":
            ax.plot(ns, [all_res[n]["benchmark"]["max_rate"][p]["rate"] / all_res[n]["benchmark"]["max_rate"]["fcfs"]["rate"]
                         for n in ns], "o-", color=f"C{k}", label=p)
    ax.set_xscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("N (requests in the trace)")
    ax.set_ylabel("max rate under SLO / fcfs's")
    ax.set_title("Max-rate ratio vs N", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, "sched_paper_vs_n.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-n", action="store_true", help="run N = 1,000 and 8,000 (fcfs, skip-join, srpt-oracle)")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if not a.report_only:
        if a.vs_n:
            for n in (1000, 8000):
                simulate(n, VS_N_POLICIES)
        else:
            simulate(a.num_requests, ALL_POLICIES)
    main_n = a.num_requests
    try:
        res = read_json(file_name(main_n))
    except FileNotFoundError:
        res = None
    if res is not None:
        b = res["benchmark"]
        print(f"# Paper protocol, N = {main_n}, ShareGPT, Poisson, seeds {SEEDS} (latency averaged per rate)\n")
        print(f"SLO {res['slo']['mean_normalized_latency']:.4g} s/token; fcfs saturation "
              f"{res['summary']['fcfs_saturation_rps']:.4g} req/s (by seed "
              f"{res['summary']['fcfs_saturation_rps_by_seed']}); wall {b['wall_s']:.0f} s; code {b['code']['head']}\n")
        print(target_table(res) + "\n")
        print(max_rate_table(res) + "\n")
        print("Mean normalized latency (s/token, seed mean; * = above the SLO):\n")
        print(curve_table(res) + "\n")
        log(f"wrote {plot_fig11(res, main_n)}")
    all_res = {}
    for n in (1000, 2000, 8000):
        try:
            all_res[n] = read_json(file_name(n))
        except FileNotFoundError:
            pass
    if len(all_res) > 1:
        print("# Max rate under the SLO vs N (fcfs, skip-join-mlfq, srpt-oracle; same sweep rule)\n")
        print(vs_n_table(all_res) + "\n")
        for n, r in sorted(all_res.items()):
            if n != main_n:
                print(f"N = {n}: wall {r['benchmark']['wall_s']:.0f} s\n")
                print(max_rate_table(r) + "\n")
                print(curve_table(r) + "\n")
        log(f"wrote {plot_vs_n(all_res)}")


if __name__ == "__main__":
    main()
