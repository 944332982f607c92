"""HTTP benchmark sweeps: the logic behind `tokenslice bench` (docs/DESIGN.md, "Benchmark protocols").

For each policy (with `--model`: one `tokenslice serve` child process per policy, torn down
after its sweep; with `--url`: the given server under one label) and each sweep point (arrival
rate, or fixed concurrency), replay the workload with `LoadClient`, compute the docs/DESIGN.md
metrics client-side, add the server's counter deltas from /metrics, and build the results file.

A policy's sweep stops early once it is clearly past the SLO (the metric above
`early_stop_factor` x the bound, or two points in a row above it): higher rates only take longer
and cannot bring it back. Max rate under the SLO is interpolated between sweep points as in
`metrics.max_rate_detail`. The SLO criterion is the paper protocol's mean normalized latency
when it is set, else the share of requests meeting the per-request TTFT / TPOT bounds
(at least `slo_attainment` of them). A point with any failed request counts as past the SLO.
No torch in this process: the engine runs in the server.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.client import LoadClient, RunResult
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.compile_wait import WAIT_COMPILED_TIMEOUT_S, CompiledWait, wait_compiled
from tokenslice.bench.server_counters import counters_as_metrics, wait_idle
from tokenslice.bench.metrics import COUNTER_KEYS, SLO, max_rate_detail, results_file, run_entry, summarize, \
    user_summary
from tokenslice.bench.metrics import per_request_data
from tokenslice.bench.datasets import DatasetCache, resolve_dataset
from tokenslice.bench.priority_patterns import PRIORITY_PATTERNS, PriorityPattern
from tokenslice.bench.servers import (STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, ServerProcess, ServerSpec, free_port,
                                      running_server)
from tokenslice.bench.workloads import (WorkloadRequest, check_user_shares, fit_context, make_workload,
                                        parse_user_shares, workload_stats)
from tokenslice.config import field_from

SLO_DECODE_FACTOR = 10  # the paper protocol: SLO = 10x the decode iteration time


@dataclass
class BenchSpec:
    """What `tokenslice bench` sweeps; the CLI flags map onto these fields."""

    workload: str
    policies: list[str]
    rates: list[float] | None = None  # open-loop arrival rates (req/s) ...
    concurrency: list[int] | None = None  # ... or fixed numbers of requests in flight (closed loop)
    num_requests: int = 200
    cv: float = 1.0
    seed: int = 0
    dataset: str | None = None
    tokenizer: str | None = None
    max_tokens_cap: int | None = None
    max_prompt_len: int | None = None
    length_filter: bool = False
    input_len: int = 128
    output_len: int = 128
    min_len: int = 1
    max_len: int = 2048
    zipf_theta: float = 1.5
    slo: SLO = field(default_factory=SLO)
    slo_auto: bool = False  # normalized-latency SLO = 10x the decode step measured on the first server
    slo_attainment: float = 0.9  # share of requests that must meet TTFT/TPOT (when no normalized bound)
    early_stop_factor: float | None = 2.0  # None: run every point
    interleave: bool = False  # all servers at once, policies taking turns at each point (drift hits all alike)
    warmup_requests: int = 4
    num_users: int | None = None  # requests spread uniformly over this many users (fairness metrics)
    user_shares: str | None = None  # "10,1,1,1": each request's user drawn by these shares (one heavy user)
    # FastSwitch §4: priorities from a pattern, sent at arrival and updated every 1/f iterations,
    # an iteration being `iteration_s` seconds (None: a lone request's decode step, measured).
    priority_pattern: str | None = field(default=None, metadata={"choices": PRIORITY_PATTERNS})
    priority_update_freq: float = field_from(PriorityPattern, "update_freq")
    priority_levels: int = field_from(PriorityPattern, "levels")
    iteration_s: float | None = None
    # Load a server only once its compiled decode is built (bench/compile_wait.py): measure compiled
    # steps, not eager ones slowed by the compiler on the same cores.
    wait_compiled: bool = True
    wait_compiled_timeout_s: float = WAIT_COMPILED_TIMEOUT_S

    def validate(self) -> None:
        if (self.rates is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rates (--rates) or concurrency (--concurrency)")
        points = self.points
        if not points or any(not (x > 0 and math.isfinite(x)) for x in points):
            raise ValueError(f"rates/concurrency must be positive finite numbers, got {points}")
        if not self.policies:
            raise ValueError("give at least one policy")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 < self.slo_attainment <= 1:
            raise ValueError(f"slo_attainment must be in (0, 1], got {self.slo_attainment}")
        if self.early_stop_factor is not None and self.early_stop_factor < 1:
            raise ValueError(f"early_stop_factor must be >= 1, got {self.early_stop_factor}")
        if self.num_users is not None and self.num_users < 1:
            raise ValueError(f"num_users must be >= 1, got {self.num_users}")
        if self.user_shares is not None:
            check_user_shares(parse_user_shares(self.user_shares), self.num_users)
        if not self.wait_compiled_timeout_s > 0:
            raise ValueError(f"wait_compiled_timeout_s must be positive, got {self.wait_compiled_timeout_s}")
        if self.iteration_s is not None and not self.iteration_s > 0:
            raise ValueError(f"iteration_s must be positive, got {self.iteration_s}")
        if self.priority is not None:
            self.priority.validate()

    @property
    def priority(self) -> PriorityPattern | None:
        """The priority pattern (seeded like the workload), or None without one."""
        if self.priority_pattern is None:
            return None
        return PriorityPattern(self.priority_pattern, self.priority_update_freq, self.priority_levels, self.seed)

    @property
    def sweep(self) -> str:
        return "rate" if self.rates is not None else "concurrency"

    @property
    def points(self) -> list[float]:
        return sorted(self.rates if self.rates is not None else (self.concurrency or []))

    def make(self, rate: float | None, cache: DatasetCache) -> list[WorkloadRequest]:
        return make_workload(self.workload, num_requests=self.num_requests, rate=rate, cv=self.cv, seed=self.seed,
                             dataset=self.dataset, tokenizer=self.tokenizer, max_tokens_cap=self.max_tokens_cap,
                             max_prompt_len=self.max_prompt_len, length_filter=self.length_filter,
                             input_len=self.input_len, output_len=self.output_len, min_len=self.min_len,
                             max_len=self.max_len, zipf_theta=self.zipf_theta, num_users=self.num_users,
                             user_shares=parse_user_shares(self.user_shares) if self.user_shares else None,
                             cache=cache)

    def followups(self, requests: Sequence[WorkloadRequest], cache: DatasetCache) -> dict[str, list[WorkloadRequest]]:
        """Later turns of the sampled conversations (sharegpt-multiturn), output lengths capped
        like the first turns'."""
        if self.workload != "sharegpt-multiturn" or self.tokenizer is None:
            return {}
        wanted = {r.conversation_id for r in requests if r.conversation_id}
        out: dict[str, list[WorkloadRequest]] = {}
        for conv in cache.conversation_records(resolve_dataset("sharegpt", self.dataset), self.tokenizer):
            cid = conv[0].conversation_id
            if cid not in wanted or cid in out:
                continue
            out[str(cid)] = [WorkloadRequest(
                request_id=f"{cid}-turn{rec.turn}", arrival_time=0.0, prompt=rec.prompt, prompt_len=rec.prompt_len,
                output_len=max(1, min(rec.output_len, self.max_tokens_cap or rec.output_len)),
                conversation_id=str(cid), turn=rec.turn) for rec in conv[1:]]
        return out

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("workload", "policies", "slo")}


# ---------------------------------------------------------------- one run

def bench_metrics(result: RunResult, slo: SLO, prefix: str = "tokenslice:") -> dict[str, Any]:
    """docs/DESIGN.md metrics from client records, server counters from /metrics deltas (None where
    the server exposes no such counter), and the client-side latency breakdown."""
    records = result.records
    m = summarize(records, slo=slo)
    scraped = counters_as_metrics(result.server_counters, prefix)
    for key in COUNTER_KEYS:  # the client cannot count these itself: only what the server says
        m[key] = scraped.get(key)
    m["queue_s"] = scraped.get("server_mean_queue_s")  # arrival to first scheduled, server-side
    m["exec_s"] = None
    done = [r for r in records if r.finished and r.ttft is not None]
    m["mean_decode_s"] = float(np.mean([r.e2e - r.ttft for r in done])) if done else None
    m["duration_s"] = result.duration_s
    m["max_send_lag_s"] = result.max_send_lag_s
    m["tokens_match_chunks"] = all(r.chunks == r.output_tokens for r in records if r.finished)
    return m


def slo_value(metrics: Mapping[str, Any], slo: SLO, attainment_target: float) -> tuple[str, float, float | None] | None:
    """(criterion name, bound, value) of one run against the SLO; value None = past it; None
    when no SLO is set."""
    failed = bool(metrics.get("num_failed"))
    if slo.mean_normalized_latency is not None:
        v = metrics.get("mean_normalized_latency")
        return "mean_normalized_latency", slo.mean_normalized_latency, None if failed else v
    if slo.is_set():
        att = metrics.get("slo_attainment")
        return "slo_violation", 1.0 - attainment_target, None if att is None else 1.0 - att
    return None


def clearly_past(history: Sequence[float | None], bound: float, factor: float) -> bool:
    """Early stop: the last point is `factor` x past the bound (or failed), or the last two are past it."""
    if not history:
        return False
    last = history[-1]
    if last is None or last > factor * bound:
        return True
    return len(history) >= 2 and all(v is None or v > bound for v in history[-2:])


def compact_records(records: Sequence[ClientRecord]) -> dict[str, Any]:
    """Per-request data for CDF plots (TTFT per request, pooled TBT as quantiles), plus the
    errors of failed requests."""
    data = per_request_data(records)
    for key in ("queue_s", "exec_s"):  # the client cannot split latency this way
        data.pop(key, None)
    data["errors"] = sorted({r.error for r in records if r.error})
    data["error_counts"] = dict(Counter(r.error for r in records if r.error).most_common())
    return data


# ---------------------------------------------------------------- the sweep

ProgressFn = Callable[[str, int, int], None]  # (description, requests done, requests in this run)


class _PolicySweep:
    """One policy's way through the sweep points, and its early stop."""

    def __init__(self, policy: str, spec: BenchSpec, slo: SLO) -> None:
        self.policy = policy
        self.spec = spec
        self.slo = slo
        self.client: LoadClient | None = None
        self.history: list[float | None] = []
        self.skipped: list[float] = []

    @property
    def done(self) -> bool:
        return bool(self.skipped)

    def run_point(self, i: int, x: float, cache: DatasetCache, tick: ProgressFn) -> dict[str, Any]:
        assert self.client is not None, "connect the sweep to its server first"
        run = _one_point(self.spec, self.client, self.policy, x, self.slo, cache, tick)
        verdict = slo_value(run["metrics"], self.slo, self.spec.slo_attainment)
        if verdict is not None and self.spec.early_stop_factor is not None:
            self.history.append(verdict[2])
            if clearly_past(self.history, verdict[1], self.spec.early_stop_factor):
                self.skipped = self.spec.points[i + 1:]
        return run


def run_bench(spec: BenchSpec, client: ClientConfig, server: ServerSpec | None = None,
              progress: ProgressFn | None = None, cache: DatasetCache | None = None) -> dict[str, Any]:
    """Every (policy, sweep point) as a docs/DESIGN.md results file with tool "bench".

    With `server`, each policy gets its own `tokenslice serve` child; without, `client.base_url`
    is benchmarked under the single label `spec.policies[0]`.
    """
    spec.validate()
    if server is None and len(spec.policies) != 1:
        raise ValueError("against a given --url there is one server: give one label in --policy")
    cache = cache or DatasetCache()
    tick = progress or (lambda _d, _n, _t: None)
    slo = spec.slo
    calibration: dict[str, Any] | None = None
    if spec.slo_auto:
        with _server_url(spec, server, client, spec.policies[0], None) as (url, _):
            lc = LoadClient(dataclasses.replace(client, base_url=url))
            warm_up(lc, spec.warmup_requests)
            step = lc.measure_decode_step()
        slo = dataclasses.replace(slo, mean_normalized_latency=SLO_DECODE_FACTOR * step)
        calibration = {"decode_step_s": step, "factor": SLO_DECODE_FACTOR, "policy": spec.policies[0]}
    if spec.priority is not None and spec.iteration_s is None:
        # Priority updates come every 1/f iterations; over HTTP an iteration is a decode step's time.
        step = calibration["decode_step_s"] if calibration else _measure_decode_step(server, client, spec)
        spec = dataclasses.replace(spec, iteration_s=step)

    sweeps = [_PolicySweep(policy, spec, slo) for policy in spec.policies]
    runs: list[dict[str, Any]] = []
    server_info: dict[str, Any] = {}
    compiled: dict[str, dict[str, Any]] = {}  # per policy: what its server said of compiled decode

    def connect(sweep: _PolicySweep, stack: ExitStack) -> None:
        nonlocal server_info
        url, waited = stack.enter_context(_server_url(spec, server, client, sweep.policy, slo.mean_normalized_latency,
                                                      spec.policies.index(sweep.policy)))
        if waited is not None:
            compiled[sweep.policy] = {"state": waited.state, "waited_s": waited.waited_s}
        sweep.client = LoadClient(dataclasses.replace(client, base_url=url))
        server_info = sweep.client.server_info()
        warm_up(sweep.client, spec.warmup_requests)

    if spec.interleave:
        with ExitStack() as stack:
            for sweep in sweeps:
                connect(sweep, stack)
            for i, x in enumerate(spec.points):
                k = i % len(sweeps)  # rotate who goes first, so no policy always runs after the same one
                for sweep in sweeps[k:] + sweeps[:k]:
                    if not sweep.done:
                        runs.append(sweep.run_point(i, x, cache, tick))
    else:
        for sweep in sweeps:
            with ExitStack() as stack:  # this policy's server stops before the next one starts
                connect(sweep, stack)
                for i, x in enumerate(spec.points):
                    if sweep.done:
                        break
                    runs.append(sweep.run_point(i, x, cache, tick))
    order = {p: i for i, p in enumerate(spec.policies)}
    runs.sort(key=lambda r: (order[r["policy"]], r["rate"] if r["rate"] is not None else r["concurrency"]))
    skipped = {sw.policy: sw.skipped for sw in sweeps if sw.skipped}

    wl = spec.make(None, cache)
    stats = workload_stats(wl)
    workload = {"name": spec.workload, **spec.describe(), "sweep": spec.sweep,
                "prompt_mean": stats.get("prompt_mean"), "output_mean": stats.get("output_mean"),
                "server": {**server_info, "started_by_bench": server is not None, "compiled_decode": compiled,
                           "model": server.model if server else server_info.get("model"),
                           "args": server.args if server else None, "threads": server.threads if server else None},
                "client": {"endpoint": client.endpoint, "ignore_eos": client.ignore_eos,
                           "send_expected_length": client.send_expected_length,
                           "max_concurrency": client.max_concurrency, "prompt_format": client.prompt_format,
                           "temperature": client.temperature},
                "slo_calibration": calibration}
    profile = Path(server.model).name if server else server_info.get("url", client.root)
    return results_file("bench", workload, profile, slo, runs, bench_summary(runs, spec, slo, skipped))


@contextmanager
def _server_url(spec: BenchSpec, server: ServerSpec | None, client: ClientConfig, policy: str,
                slo_normalized_latency: float | None, index: int = 0
                ) -> Iterator[tuple[str, CompiledWait | None]]:
    """The policy's server (started here with `server`, else client.base_url) once its compiled
    decode is built (with spec.wait_compiled), and what it said of it."""
    with ExitStack() as stack:
        url = client.base_url if server is None else stack.enter_context(
            running_server(server, policy, slo_normalized_latency, index))
        waited = None
        if spec.wait_compiled:
            waited = wait_compiled(dataclasses.replace(client, base_url=url), spec.wait_compiled_timeout_s)
        yield url, waited


def warm_up(lc: LoadClient, n: int) -> None:
    """A few requests the results ignore: the first steps of a fresh server are slower."""
    if n > 0:
        lc.run([WorkloadRequest(f"warmup-{i}", 0.0, None, 16, 16) for i in range(n)])
        wait_idle(lc.cfg)


def _measure_decode_step(server: ServerSpec | None, client: ClientConfig, spec: BenchSpec) -> float:
    """A lone request's decode step (s) on the first policy's server, after its warm-up."""
    with _server_url(spec, server, client, spec.policies[0], None) as (url, _):
        lc = LoadClient(dataclasses.replace(client, base_url=url))
        warm_up(lc, spec.warmup_requests)
        return lc.measure_decode_step()


def _one_point(spec: BenchSpec, lc: LoadClient, policy: str, x: float, slo: SLO, cache: DatasetCache,
               tick: ProgressFn) -> dict[str, Any]:
    rate = x if spec.sweep == "rate" else None
    # Lengths past the served context would only fail: they are capped to it (and counted).
    context = lc.max_model_len()
    requests, capped = fit_context(spec.make(rate, cache), context, lc.cfg)
    followups = spec.followups(requests, cache)
    total = len(requests) + sum(len(followups.get(r.conversation_id or "", ())) for r in requests)
    point_cfg = lc.cfg if spec.sweep == "rate" else dataclasses.replace(lc.cfg, max_concurrency=int(x))
    done = 0
    desc = f"{policy} {spec.sweep}={x:g}"

    def on_record(_rec: ClientRecord) -> None:
        nonlocal done
        done += 1
        tick(desc, done, total)

    result = LoadClient(point_cfg).run(requests, followups, progress=on_record, priority=spec.priority,
                                       iteration_s=spec.iteration_s)
    wait_idle(lc.cfg)  # aborted (timed-out) requests must not load the next point
    metrics = bench_metrics(result, slo, lc.cfg.metrics_prefix)
    users = user_summary(result.records)
    extra = {**({"per_user": users} if users else {}),
             **({"priority_updates": result.priority_updates} if result.priority_updates else {}),
             **({"capped_to_context": {"max_model_len": context, "requests": capped}} if capped else {})}
    return run_entry(policy, None, rate, metrics, cv=spec.cv if rate else None, num_requests=len(result.records),
                     seed=spec.seed, concurrency=int(x) if spec.sweep == "concurrency" else point_cfg.max_concurrency,
                     server_counters=result.server_counters, per_request=compact_records(result.records), **extra)


def bench_summary(runs: Sequence[Mapping[str, Any]], spec: BenchSpec, slo: SLO,
                  skipped: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Max rate (or concurrency) under the SLO per policy, its ratio to fcfs, and early stops."""
    x_key = spec.sweep
    summary: dict[str, Any] = {"slo_metric": None, "max_rate_under_slo": {}, "fcfs_saturation_rps": None,
                               "early_stopped": {k: list(v) for k, v in skipped.items()}}
    per_policy: dict[str, list[tuple[float, float | None]]] = {}
    bound = None
    for run in runs:
        verdict = slo_value(run["metrics"], slo, spec.slo_attainment)
        if verdict is None:
            continue
        summary["slo_metric"], bound = verdict[0], verdict[1]
        per_policy.setdefault(run["policy"], []).append((float(run[x_key]), verdict[2]))
    if bound is None:
        return summary
    detail = {p: max_rate_detail([x for x, _ in pts], [v for _, v in pts], bound) for p, pts in per_policy.items()}
    name = "max_rate_under_slo" if x_key == "rate" else "max_concurrency_under_slo"
    summary[name] = {p: d.rate for p, d in detail.items()}
    summary[name.replace("under_slo", "censored")] = sorted(p for p, d in detail.items() if d.censored)
    summary[name.replace("under_slo", "infeasible")] = sorted(p for p, d in detail.items() if d.infeasible)
    base = summary[name].get("fcfs")
    if base and "fcfs" not in summary[name.replace("under_slo", "censored")]:  # no ratio to a lower bound
        summary[name.replace("under_slo", "ratio_vs_fcfs")] = {p: v / base for p, v in summary[name].items()}
    return summary


__all__ = ["BenchSpec", "ServerSpec", "ServerProcess", "running_server", "free_port", "STARTUP_TIMEOUT_S",
           "STOP_TIMEOUT_S", "bench_metrics", "slo_value",
           "clearly_past", "compact_records", "run_bench", "bench_summary", "warm_up", "SLO_DECODE_FACTOR"]
