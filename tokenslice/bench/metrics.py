"""Latency statistics exactly as docs/DESIGN.md ("Metrics") defines them, and the results file.

- e2e latency (JCT) = finish - arrival; normalized latency = e2e / output tokens (the papers'
  "latency (s/token)").
- TTFT = first token - arrival; TBT = every gap between consecutive tokens, pooled over requests;
  TPOT = (e2e - TTFT) / (output tokens - 1).
- SLO attainment = share of *all* requests meeting the SLO (failed ones count and never meet it);
  goodput = requests meeting it per second of makespan; max rate under SLO = highest arrival rate
  whose metric stays within the SLO, interpolated linearly between sweep points.
- Stall (docs/DESIGN.md, "Stall guard"): a reader takes `delivery_rate` tokens/s from a stream's
  first token on and waits when the next has not arrived; a request's stall = the time it waited,
  `stall_s` = the sum over finished requests; QoE = Andes' (tokenslice/delivery.py), averaged.
- Percentiles are nearest-rank.
- Fairness across users (FastSwitch §4, VTC's measures): a user's service = the tokens the
  server processed for it (prompt tokens, counted when the first output token arrives, plus
  output tokens); `user_summary` gives per-user service and latency, `jain_index` Jain's index
  (sum x)^2 / (n sum x^2) over users' service and over their mean normalized latency, and
  `max_service_gap` the largest difference in service two users received over any interval in
  which both were backlogged (had a request arrived and not finished).

Undefined statistics (no finished request) are None, so results files stay valid JSON.
No torch here.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenslice.delivery import DEFAULT_DELIVERY_RATE, qoe, stall_seconds

# Metric keys every results-file run carries (docs/DESIGN.md, "Results file"); more may be added.
METRIC_KEYS = ("mean_normalized_latency", "p95_normalized_latency", "mean_ttft", "p99_ttft", "p999_ttft",
               "mean_tbt", "p99_tbt", "p999_tbt", "stall_s", "mean_qoe", "started_preemptions", "mean_jct", "p95_jct", "throughput_rps", "throughput_tok_s",
               "preemptions", "recomputed_tokens", "swap_out_bytes", "swap_in_bytes", "swap_ops",
               "swap_stall_s", "queue_s", "exec_s")

# Server-side counters summed over requests (totals for the run).
COUNTER_KEYS = ("preemptions", "started_preemptions", "recomputed_tokens", "swap_out_bytes", "swap_in_bytes", "swap_ops", "swap_stall_s")
# Server-side times averaged over requests (mean seconds per request).
MEAN_TIME_KEYS = ("queue_s", "exec_s")

RESULT_TOOLS = ("simulate", "bench")


@dataclass
class RequestRecord:
    """What one request did, as seen by the client (times in seconds on one clock) plus optional
    server-side counters (zero when the server does not report them)."""

    request_id: str
    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token arrived
    finish_time: float | None = None
    ok: bool = True
    error: str | None = None
    user: str | None = None
    priority: int | None = None
    preemptions: int = 0
    started_preemptions: int = 0  # preemptions after its first token
    recomputed_tokens: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_ops: int = 0
    swap_stall_s: float = 0.0
    queue_s: float = 0.0  # waiting (never run or preempted) between arrival and finish
    exec_s: float = 0.0  # in a running batch

    @classmethod
    def from_token_times(cls, request_id: str, arrival: float, token_times: Sequence[float],
                         prompt_tokens: int = 0, finish_time: float | None = None, **extra: Any) -> RequestRecord:
        """A finished request from its token timestamps; finish defaults to the last token."""
        times = [float(t) for t in token_times]
        return cls(request_id=request_id, arrival=arrival, prompt_tokens=prompt_tokens, output_tokens=len(times),
                   first_token_time=times[0] if times else None, token_times=times,
                   finish_time=finish_time if finish_time is not None else (times[-1] if times else None), **extra)

    @property
    def finished(self) -> bool:
        return self.ok and self.finish_time is not None

    @property
    def e2e(self) -> float | None:
        return self.finish_time - self.arrival if self.finished else None

    @property
    def normalized_latency(self) -> float | None:
        e2e = self.e2e
        return e2e / self.output_tokens if e2e is not None and self.output_tokens > 0 else None

    @property
    def ttft(self) -> float | None:
        return self.first_token_time - self.arrival if self.ok and self.first_token_time is not None else None

    @property
    def tbt(self) -> list[float]:
        return np.diff(self.token_times).tolist() if self.ok and len(self.token_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        e2e, ttft = self.e2e, self.ttft
        if e2e is None or ttft is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objective; None fields are not checked. Per request, a finished request
    meets it when its normalized latency, TTFT and TPOT are each within their bound; for a
    whole run (the paper protocol) the mean normalized latency is compared instead."""

    mean_normalized_latency: float | None = None
    ttft: float | None = None
    tpot: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return {"mean_normalized_latency": self.mean_normalized_latency, "ttft": self.ttft, "tpot": self.tpot}

    @classmethod
    def from_any(cls, slo: SLO | Mapping[str, Any] | float | None) -> SLO:
        """An SLO from an SLO, a results-file dict, a bare number (normalized latency) or None."""
        if slo is None:
            return cls()
        if isinstance(slo, SLO):
            return slo
        if isinstance(slo, Mapping):
            return cls(slo.get("mean_normalized_latency"), slo.get("ttft"), slo.get("tpot"))
        return cls(mean_normalized_latency=float(slo))

    def is_set(self) -> bool:
        return any(v is not None for v in (self.mean_normalized_latency, self.ttft, self.tpot))


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least q% of values <= it; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    arr = np.sort(np.fromiter((float(v) for v in values), dtype=float))
    if len(arr) == 0:
        return None
    rank = max(math.ceil(q / 100 * len(arr) - 1e-9), 1)  # tolerance: 99.9/100*1000 must be rank 999
    return float(arr[rank - 1])


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """Whether one request met the SLO; failed or unfinished requests never do."""
    if not rec.finished:
        return False
    checks = ((slo.mean_normalized_latency, rec.normalized_latency), (slo.ttft, rec.ttft), (slo.tpot, rec.tpot))
    # A metric the request does not define (TPOT of a one-token answer) cannot violate its bound.
    return all(bound is None or value is None or value <= bound for bound, value in checks)


def makespan(records: Sequence[RequestRecord]) -> float | None:
    """First arrival to last finish (failed requests included: they held the server too)."""
    ends = [r.finish_time for r in records if r.finish_time is not None]
    if not records or not ends:
        return None
    return max(ends) - min(r.arrival for r in records)


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float | None:
    """Share of all requests (failed ones in the denominator) that met the SLO."""
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else None


def goodput(records: Sequence[RequestRecord], slo: SLO) -> float | None:
    """Requests per second of makespan that met the SLO."""
    span = makespan(records)
    if not span or span <= 0:
        return None
    return sum(meets_slo(r, slo) for r in records) / span


def summarize(records: Sequence[RequestRecord], slo: SLO | Mapping[str, Any] | float | None = None,
              counters: Mapping[str, float] | None = None,
              delivery_rate: float = DEFAULT_DELIVERY_RATE) -> dict[str, Any]:
    """All METRIC_KEYS plus percentiles, counts, SLO attainment and goodput for one run.

    Latency statistics cover finished requests; throughput is finished requests (and their output
    tokens) over the makespan. `counters` (e.g. engine-wide swap totals) override the per-request
    sums of the same keys.
    """
    done = [r for r in records if r.finished]
    norm = [x for x in (r.normalized_latency for r in done) if x is not None]
    ttft = [x for x in (r.ttft for r in done) if x is not None]
    tpot = [x for x in (r.tpot for r in done) if x is not None]
    jct = [r.e2e for r in done]
    tbt = [g for r in done for g in r.tbt]
    span = makespan(records)
    rate_ok = span is not None and span > 0
    out: dict[str, Any] = {
        "num_requests": len(records), "num_finished": len(done), "num_failed": len(records) - len(done),
        "mean_normalized_latency": _mean(norm),
        "p50_normalized_latency": percentile(norm, 50), "p95_normalized_latency": percentile(norm, 95),
        "p99_normalized_latency": percentile(norm, 99),
        "mean_ttft": _mean(ttft), "p50_ttft": percentile(ttft, 50), "p95_ttft": percentile(ttft, 95),
        "p99_ttft": percentile(ttft, 99), "p999_ttft": percentile(ttft, 99.9),
        "mean_tbt": _mean(tbt), "p50_tbt": percentile(tbt, 50), "p99_tbt": percentile(tbt, 99),
        "p999_tbt": percentile(tbt, 99.9),
        "stall_s": float(sum(stall_seconds(r.token_times, delivery_rate) for r in done)),
        "mean_qoe": _mean([q for r in done if (q := qoe(r.arrival, r.token_times, delivery_rate)) is not None]),
        "delivery_rate": delivery_rate,
        "mean_tpot": _mean(tpot), "p99_tpot": percentile(tpot, 99),
        "mean_jct": _mean(jct), "p50_jct": percentile(jct, 50), "p95_jct": percentile(jct, 95),
        "p99_jct": percentile(jct, 99),
        "makespan_s": span,
        "throughput_rps": len(done) / span if rate_ok else 0.0,
        "throughput_tok_s": sum(r.output_tokens for r in done) / span if rate_ok else 0.0,
    }
    for key in COUNTER_KEYS:
        total = sum(getattr(r, key) for r in records)
        out[key] = float(total) if key == "swap_stall_s" else int(total)
    for key in MEAN_TIME_KEYS:
        out[key] = float(np.mean([getattr(r, key) for r in records])) if records else 0.0
    out.update(fairness_metrics(records))
    if counters:
        out.update({k: v for k, v in counters.items()})
    slo_obj = SLO.from_any(slo)
    if slo_obj.is_set():
        out["slo_attainment"] = slo_attainment(records, slo_obj)
        out["goodput_rps"] = goodput(records, slo_obj)
    return out


# ---------------------------------------------------------------- fairness across users

def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has all;
    None for no values, 1.0 when all are zero."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return None
    sq = float(np.sum(x * x))
    return float(np.sum(x)) ** 2 / (len(x) * sq) if sq > 0 else 1.0


def _service_events(rec: RequestRecord) -> tuple[list[float], list[float]]:
    """(time, tokens) of each piece of service one request got: its prompt with its first token."""
    times = list(rec.token_times)
    amounts = [1.0] * len(times)
    if amounts:
        amounts[0] += rec.prompt_tokens
    return times, amounts


def user_summary(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Per user (records with a `user`): requests, finished, service tokens, mean normalized
    latency, mean TTFT and mean e2e latency of its finished requests."""
    by_user: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.user is not None:
            by_user.setdefault(r.user, []).append(r)
    out = {}
    for user, recs in sorted(by_user.items()):
        done = [r for r in recs if r.finished]
        norm = [x for x in (r.normalized_latency for r in done) if x is not None]
        ttft = [x for x in (r.ttft for r in done) if x is not None]
        out[user] = {"num_requests": len(recs), "num_finished": len(done),
                     "service_tokens": sum(sum(_service_events(r)[1]) for r in recs),
                     "mean_normalized_latency": _mean(norm), "mean_ttft": _mean(ttft),
                     "mean_jct": _mean([r.e2e for r in done])}
    return out


def _backlog(recs: Sequence[RequestRecord], end: float) -> list[tuple[float, float]]:
    """The union of [arrival, finish] over a user's requests (unfinished ones run to `end`)."""
    spans = sorted((r.arrival, r.finish_time if r.finish_time is not None else end) for r in recs)
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def max_service_gap(records: Sequence[RequestRecord]) -> float | None:
    """max over pairs of users u, v and intervals [t1, t2] in which both were backlogged of
    |(W_u(t2) - W_u(t1)) - (W_v(t2) - W_v(t1))|, W being cumulative service tokens (VTC's
    fairness measure). None with fewer than two users."""
    by_user: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.user is not None:
            by_user.setdefault(r.user, []).append(r)
    if len(by_user) < 2:
        return None
    end = max([r.finish_time for r in records if r.finish_time is not None]
              + [t for r in records for t in r.token_times] + [r.arrival for r in records])
    service: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for user, recs in by_user.items():
        events = sorted((t, a) for r in recs for t, a in zip(*_service_events(r), strict=True))
        service[user] = (np.array([t for t, _ in events]), np.cumsum([a for _, a in events]))
    backlog = {u: _backlog(recs, end) for u, recs in by_user.items()}

    def cumulative(user: str, at: np.ndarray) -> np.ndarray:
        times, total = service[user]
        idx = np.searchsorted(times, at, side="right")  # service at exactly t counts by t
        return np.where(idx > 0, np.concatenate([[0.0], total])[idx], 0.0)

    users = sorted(by_user)
    gap = 0.0
    for i, u in enumerate(users):
        for v in users[i + 1:]:
            both = _intersect(backlog[u], backlog[v])
            if not both:
                continue
            ends = np.array([t for span in both for t in span])
            at = np.unique(np.concatenate([service[u][0], service[v][0], ends]))
            d = cumulative(u, at) - cumulative(v, at)
            for lo, hi in both:
                window = d[np.searchsorted(at, lo):np.searchsorted(at, hi, side="right")]
                gap = max(gap, float(window.max() - window.min()))
    return gap


def _intersect(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlaps (of positive length) of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def fairness_metrics(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Results-file fairness keys for a run whose requests carry users (empty otherwise)."""
    users = user_summary(records)
    if not users:
        return {}
    norm = [u["mean_normalized_latency"] for u in users.values() if u["mean_normalized_latency"] is not None]
    return {"num_users": len(users), "jain_service": jain_index([u["service_tokens"] for u in users.values()]),
            "jain_normalized_latency": jain_index(norm), "max_service_gap_tokens": max_service_gap(records)}


@dataclass(frozen=True)
class MaxRate:
    """Result of a rate sweep against an SLO.

    censored: no sweep point exceeded the SLO, so the true maximum is at least `rate`.
    infeasible: even the lowest rate exceeded it (`rate` is 0.0).
    """

    rate: float
    censored: bool = False
    infeasible: bool = False


def max_rate_detail(rates: Sequence[float], metric_values: Sequence[float | None], slo: float) -> MaxRate:
    """Highest rate whose metric stays <= slo, interpolated linearly between the last point within
    the SLO and the first past it (sorted by rate; a None/NaN metric counts as past the SLO)."""
    if len(rates) != len(metric_values):
        raise ValueError(f"{len(rates)} rates but {len(metric_values)} metric values")
    if not rates:
        raise ValueError("max_rate_under_slo needs at least one sweep point")
    points = sorted(zip((float(r) for r in rates),
                        (math.nan if v is None else float(v) for v in metric_values)), key=lambda p: p[0])

    def within(v: float) -> bool:
        return not math.isnan(v) and v <= slo

    first_bad = next((i for i, (_, v) in enumerate(points) if not within(v)), None)
    if first_bad is None:
        return MaxRate(points[-1][0], censored=True)
    if first_bad == 0:
        return MaxRate(0.0, infeasible=True)
    (r0, v0), (r1, v1) = points[first_bad - 1], points[first_bad]
    if math.isnan(v1) or math.isinf(v1):
        return MaxRate(r0)  # nothing to interpolate toward: keep the last rate known to be within
    return MaxRate(r0 + (slo - v0) * (r1 - r0) / (v1 - v0))


def max_rate_under_slo(rates: Sequence[float], metric_values: Sequence[float | None], slo: float) -> float:
    """`max_rate_detail(...).rate`: 0.0 if even the lowest rate fails; the highest rate if none
    fails (check `max_rate_detail(...).censored` to tell that case apart)."""
    return max_rate_detail(rates, metric_values, slo).rate


def run_entry(policy: str, preemption: str | None, rate: float | None, metrics: Mapping[str, Any], *,
              load: float | None = None, cv: float | None = None, num_requests: int | None = None,
              seed: int | None = None, **extra: Any) -> dict[str, Any]:
    """One element of a results file's "runs" list."""
    missing = [k for k in METRIC_KEYS if k not in metrics]
    if missing:
        raise ValueError(f"run metrics missing required keys: {', '.join(missing)}")
    return {"policy": policy, "preemption": preemption, "rate": rate, "load": load, "cv": cv,
            "num_requests": num_requests, "seed": seed, **extra, "metrics": dict(metrics)}


def run_key(run: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    """The summary key of a run: its policy, plus "/preemption" when one policy ran with several."""
    modes = {r.get("preemption") for r in runs if r.get("policy") == run.get("policy")}
    return f"{run['policy']}/{run.get('preemption')}" if len(modes) > 1 else str(run["policy"])


def sweep_summary(runs: Sequence[Mapping[str, Any]], slo: SLO | Mapping[str, Any] | float,
                  metric: str = "mean_normalized_latency",
                  fcfs_saturation_rps: float | None = None) -> dict[str, Any]:
    """The results file's "summary": max rate under the SLO per policy, from runs with a rate.

    The bound is the SLO's mean_normalized_latency (the paper protocol), or `slo` itself when it is a
    number: pass e.g. metric="p99_ttft", slo=2.0 to sweep against another metric.
    """
    bound = SLO.from_any(slo).mean_normalized_latency if not isinstance(slo, (int, float)) else float(slo)
    if bound is None:
        raise ValueError("sweep_summary needs a numeric bound for the metric")
    groups: dict[str, list[tuple[float, float | None]]] = {}
    for run in runs:
        if run.get("rate") is None:
            continue
        groups.setdefault(run_key(run, runs), []).append((float(run["rate"]), run["metrics"].get(metric)))
    detail = {k: max_rate_detail([p[0] for p in pts], [p[1] for p in pts], bound) for k, pts in groups.items()}
    return {"max_rate_under_slo": {k: d.rate for k, d in detail.items()},
            "max_rate_censored": sorted(k for k, d in detail.items() if d.censored),
            "slo_metric": metric, "fcfs_saturation_rps": fcfs_saturation_rps}


def results_file(tool: str, workload: Mapping[str, Any], profile: str, slo: SLO | Mapping[str, Any] | float | None,
                 runs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> dict[str, Any]:
    """The docs/DESIGN.md results-file dict (written by `bench` and `simulate` with --out)."""
    if tool not in RESULT_TOOLS:
        raise ValueError(f"tool must be one of {', '.join(RESULT_TOOLS)}, got {tool!r}")
    for i, run in enumerate(runs):
        if "policy" not in run or "metrics" not in run:
            raise ValueError(f"run {i} needs 'policy' and 'metrics'")
        missing = [k for k in METRIC_KEYS if k not in run["metrics"]]
        if missing:
            raise ValueError(f"run {i} ({run['policy']}) metrics missing: {', '.join(missing)}")
    summ = dict(summary)
    summ.setdefault("max_rate_under_slo", {})
    summ.setdefault("fcfs_saturation_rps", None)
    return {"tool": tool, "workload": dict(workload), "profile": profile, "slo": SLO.from_any(slo).to_dict(),
            "runs": [dict(r) for r in runs], "summary": summ}


__all__ = ["METRIC_KEYS", "COUNTER_KEYS", "RequestRecord", "SLO", "MaxRate", "percentile", "meets_slo", "makespan",
           "slo_attainment", "goodput", "summarize", "max_rate_detail", "max_rate_under_slo", "run_entry", "run_key",
           "sweep_summary", "results_file", "jain_index", "user_summary", "max_service_gap", "fairness_metrics"]


# TBT CDF kept per run in this many quantile points (pooled TBTs are too many to store).
TBT_CDF_POINTS = np.concatenate([np.linspace(0.0, 0.99, 100), np.linspace(0.991, 1.0, 10)])



def per_request_data(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Compact per-request data for CDF plots: TTFT, normalized latency, breakdown per request, and
    the pooled TBT distribution as quantiles (every gap would be ~N x output-length numbers)."""
    def col(values: Sequence[float | None]) -> list[float | None]:
        return [None if v is None else float(f"{v:.6g}") for v in values]

    tbt = np.array([g for r in records for g in r.tbt])
    return {"ttft": col([r.ttft for r in records]), "normalized_latency": col([r.normalized_latency for r in records]),
            "output_tokens": [r.output_tokens for r in records], "queue_s": col([r.queue_s for r in records]),
            "exec_s": col([r.exec_s for r in records]),
            "tbt_cdf": {"q": col(TBT_CDF_POINTS.tolist()),
                        "v": col(np.quantile(tbt, TBT_CDF_POINTS).tolist()) if len(tbt) else []}}
