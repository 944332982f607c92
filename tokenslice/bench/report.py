"""Tables and matplotlib figures from results files (docs/DESIGN.md, "Results file").

Figures follow the papers: mean normalized latency against arrival rate (or load) per policy with
the SLO line (FastServe Fig. 11), a latency breakdown into queueing / execution / swapping per
policy (FastServe Fig. 15(b)), and CDFs of TTFT and TBT when runs carry per-request data.
Several results files merge into one table and one figure; series are named by policy, plus the
file's name when two files share a policy. Seeds are averaged per point. No torch here.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.metrics import run_key


@dataclass
class Series:
    """One policy's runs from one file, averaged over seeds per sweep point."""

    label: str
    policy: str
    slo: float | None
    points: dict[float, list[Mapping[str, Any]]] = field(default_factory=dict)  # x -> runs (one per seed)

    def xs(self) -> list[float]:
        return sorted(self.points)

    def mean(self, x: float, metric: str) -> float | None:
        vals = [r["metrics"].get(metric) for r in self.points[x]]
        return None if not vals or any(v is None for v in vals) else float(np.mean(vals))

    def mean_field(self, x: float, key: str) -> float | None:
        vals = [r.get(key) for r in self.points[x]]
        return None if not vals or any(v is None for v in vals) else float(np.mean(vals))


def load_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"results file {str(path)!r} does not exist")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "runs" not in data:
            raise ValueError(f"{str(path)!r} is not a results file (no 'runs')")
        out.append(data)
    return out


def x_axis(results: Sequence[Mapping[str, Any]]) -> str:
    """"load" when every file swept load (steady-state protocol), "concurrency" when every file
    swept a closed loop's concurrency (`bench --concurrency`), else "rate"."""
    sweeps = {(r.get("workload") or {}).get("sweep") for r in results}
    return sweeps.pop() if len(sweeps) == 1 and sweeps <= {"load", "concurrency"} else "rate"


def collect_series(results: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None,
                   x_key: str | None = None) -> list[Series]:
    """Series over all files; a policy present in several files gets " [file name]" appended."""
    names = list(names) if names is not None else [f"#{i + 1}" for i in range(len(results))]
    x_key = x_key or x_axis(results)
    keys_per_file = [{run_key(run, res["runs"]) for run in res["runs"]} for res in results]
    series: dict[str, Series] = {}
    for res, name, keys in zip(results, names, keys_per_file, strict=True):
        slo = (res.get("slo") or {}).get("mean_normalized_latency")
        for run in res["runs"]:
            key = run_key(run, res["runs"])
            shared = sum(key in other for other in keys_per_file) > 1
            label = f"{key} [{name}]" if shared else key
            x = run.get(x_key)
            if x is None:
                continue
            s = series.setdefault(label, Series(label, str(run["policy"]), slo))
            s.points.setdefault(float(x), []).append(run)
    return list(series.values())


# ---------------------------------------------------------------- tables

def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.4g}"


TABLE_COLUMNS = (("mean norm s/tok", "mean_normalized_latency", 1.0), ("p95 norm", "p95_normalized_latency", 1.0),
                 ("mean TTFT s", "mean_ttft", 1.0), ("p99 TTFT s", "p99_ttft", 1.0),
                 ("p99 TBT ms", "p99_tbt", 1e3), ("p99.9 TBT ms", "p999_tbt", 1e3), ("stall s", "stall_s", 1.0),
                 ("QoE", "mean_qoe", 1.0), ("tput req/s", "throughput_rps", 1.0),
                 ("preempt", "preemptions", 1.0), ("started", "started_preemptions", 1.0))
LATE_CLIENT_S = 0.1  # bench runs whose client sent a request this late are flagged in the summary
OPTIONAL_COLUMNS = (("SLO att.", "slo_attainment", 1.0), ("goodput req/s", "goodput_rps", 1.0),
                    ("failed", "num_failed", 1.0))


def format_table(results: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> str:
    """One row per policy and sweep point (seeds averaged), with the ratio to fcfs at that point."""
    x_key = x_axis(results)
    series = collect_series(results, names, x_key)
    by_label = {s.label: s for s in series}
    # SLO attainment and goodput where runs carry them (runs swept against a per-request SLO).
    extra = [c for c in OPTIONAL_COLUMNS if any(c[1] in run["metrics"] for res in results for run in res["runs"])]
    columns = list(TABLE_COLUMNS) + extra
    x_cols = ["rate", "load"] if x_key != "concurrency" else ["concurrency", "rate"]
    header = ["policy", *x_cols, "seeds"] + [c[0] for c in columns] + ["vs fcfs"]
    rows = [header]
    for s in series:
        base = by_label.get("fcfs" + s.label[len(s.policy):])  # same preemption and file
        for x in s.xs():
            row = [s.label, *(_fmt(s.mean_field(x, c)) for c in x_cols), str(len(s.points[x]))]
            row += [_fmt(s.mean(x, key), scale) for _, key, scale in columns]
            ratio = None
            if base is not None and x in base.points:
                mine, theirs = s.mean(x, "mean_normalized_latency"), base.mean(x, "mean_normalized_latency")
                ratio = mine / theirs if mine is not None and theirs else None
            row.append("-" if ratio is None else f"{ratio:.3f}")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(results: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> str:
    """SLO, saturation and max rate (or load) under the SLO, one line per file."""
    names = list(names) if names is not None else [f"#{i + 1}" for i in range(len(results))]
    out = []
    for res, name in zip(results, names, strict=True):
        summ = res.get("summary") or {}
        slo = (res.get("slo") or {}).get("mean_normalized_latency")
        parts = [f"{name}: profile {res.get('profile')}", f"SLO mean normalized latency {_fmt(slo)} s/token"]
        if summ.get("fcfs_saturation_rps") is not None:
            parts.append(f"fcfs saturation {summ['fcfs_saturation_rps']:.4g} req/s")
        out.append(", ".join(parts))
        for label, key, cens in (("max rate under SLO (req/s)", "max_rate_under_slo", "max_rate_censored"),
                                 ("max load under SLO", "max_load_under_slo", "max_load_censored"),
                                 ("max concurrency under SLO", "max_concurrency_under_slo",
                                  "max_concurrency_censored")):
            vals = summ.get(key)
            if vals:
                censored = set(summ.get(cens) or [])  # "+": no sweep point broke the SLO
                out.append(f"  {label}: " + ", ".join(f"{p} {v:.4g}{'+' if p in censored else ''}"
                                                      for p, v in vals.items()))
        for key in ("max_rate_ratio_vs_fcfs", "max_concurrency_ratio_vs_fcfs"):
            if summ.get(key):
                out.append("  ratio to fcfs: " + ", ".join(f"{p} {v:.3g}" for p, v in summ[key].items()))
        late = [(r["policy"], r.get("rate") or r.get("concurrency"), r["metrics"]["max_send_lag_s"])
                for r in res["runs"] if (r["metrics"].get("max_send_lag_s") or 0.0) > LATE_CLIENT_S]
        if late:  # a client behind its own schedule sends bursts and stamps tokens late
            out.append(f"  client behind schedule by > {LATE_CLIENT_S:g} s at: " + ", ".join(
                f"{p} {x:g} ({lag:.2f} s)" for p, x, lag in late))
        if summ.get("early_stopped"):
            out.append("  stopped early (past the SLO), points not run: " + "; ".join(
                f"{p} {', '.join(f'{x:g}' for x in xs)}" for p, xs in summ["early_stopped"].items()))
    return "\n".join(out)


# ---------------------------------------------------------------- figures

def _focus_x(series: Sequence[Series]) -> float | None:
    """The most loaded sweep point every series has (where the breakdown and CDFs are drawn)."""
    common = set.intersection(*(set(s.points) for s in series)) if series else set()
    return max(common) if common else None


def plot_results(results: Sequence[Mapping[str, Any]], out: str | Path, names: Sequence[str] | None = None) -> Path:
    """Write a PNG: latency vs rate/load with the SLO, latency breakdown, and TTFT/TBT CDFs."""
    import matplotlib

    matplotlib.use("Agg")  # headless: figures go to files only
    import matplotlib.pyplot as plt

    x_key = x_axis(results)
    series = collect_series(results, names, x_key)
    if not series:
        raise ValueError("no runs with a rate/load to plot")
    focus = _focus_x(series)
    has_cdf = focus is not None and all("per_request" in r for s in series for r in s.points[focus])
    from matplotlib.ticker import NullFormatter

    if has_cdf:
        fig, grid = plt.subplots(2, 2, figsize=(11, 8.5))
        axes = grid.ravel()
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = {s.label: f"C{i % 10}" for i, s in enumerate(series)}

    ax = axes[0]
    for s in series:
        xs = [x for x in s.xs() if s.mean(x, "mean_normalized_latency") is not None]
        ax.plot(xs, [s.mean(x, "mean_normalized_latency") for x in xs], "o-", color=colors[s.label], label=s.label)
    for slo in sorted({s.slo for s in series if s.slo is not None}):
        ax.axhline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:.3g} s/token")
    ax.set_yscale("log")
    ax.set_xlabel({"load": "load (fraction of fcfs saturation)",
                   "concurrency": "requests in flight"}.get(x_key, "arrival rate (req/s)"))
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title("Latency vs " + x_key)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    if focus is not None:
        labels = [s.label for s in series]
        parts = (("queueing", "queue_s", "C7"), ("execution", "exec_s", "C0"), ("swapping", "mean_swap_s", "C3"))
        if all(r["metrics"].get("mean_decode_s") is not None for s in series for r in s.points[focus]):
            # Measured over HTTP: the client sees only the wait for the first token and the rest.
            parts = (("first token (TTFT)", "mean_ttft", "C7"), ("decode (e2e - TTFT)", "mean_decode_s", "C0"))
        bottom = np.zeros(len(series))
        for name, key, color in parts:
            vals = np.array([s.mean(focus, key) or 0.0 for s in series])
            ax.bar(labels, vals, bottom=bottom, label=name, color=color)
            bottom += vals
        ax.set_ylabel("mean seconds per request")
        ax.set_title(f"Latency breakdown at {x_key} {focus:.3g}")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.set_ylim(0, max(bottom.max(), 1e-9) * 1.3)  # headroom for the legend
        ax.legend(fontsize=8, loc="upper right", ncols=3)

    if has_cdf:
        assert focus is not None
        ax = axes[2]
        for s in series:
            ttft = np.sort([v for r in s.points[focus] for v in r["per_request"]["ttft"] if v is not None and v > 0])
            if len(ttft):
                ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), color=colors[s.label], label=s.label)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("CDF")
        ax.set_title(f"TTFT at {x_key} {focus:.3g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

        ax = axes[3]
        for s in series:
            cdfs = [r["per_request"]["tbt_cdf"] for r in s.points[focus] if r["per_request"]["tbt_cdf"]["v"]]
            if cdfs:
                # Quantile-averaged over seeds (each seed stores the same quantile grid).
                v = np.mean([c["v"] for c in cdfs], axis=0)
                tail = 1.0 - np.asarray(cdfs[0]["q"], dtype=float)
                keep = tail > 0  # the maximum has no place on a log axis
                stall = s.mean(focus, "stall_s")  # the reader's wait (docs/DESIGN.md, Stall guard)
                label = s.label if stall is None else f"{s.label} (reader stall {stall:.3g} s)"
                ax.plot(np.maximum(v[keep], 1e-9) * 1e3, tail[keep], color=colors[s.label], label=label)
        # Log-log complementary CDF: nearly every gap is one decode step; the tail is the story.
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TBT (ms)")
        ax.set_ylabel("1 - CDF")
        ax.set_title(f"TBT tail at {x_key} {focus:.3g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    profiles = sorted({str(r.get("profile")) for r in results})
    counts = sorted({(r.get("workload") or {}).get("num_requests") for r in results} - {None})
    fig.suptitle(f"{', '.join(profiles)}; N = {', '.join(map(str, counts))}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["Series", "load_results", "x_axis", "collect_series", "format_table", "format_summary", "plot_results"]
