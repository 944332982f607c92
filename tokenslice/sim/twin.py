"""Twin runs: one arrival trace on the real engine over HTTP and in the simulator, side by side.

The logic behind `tokenslice twin`. The same trace (prompts as token ids of each request's
length, arrival times, output lengths sent as max_tokens with ignore_eos) is replayed:

- real: `repeats` times against `tokenslice serve` (a child process per policy, or `--url`), timed
  by the HTTP client (`bench/client.py`); the spread over repeats is the real engine's own noise;
- simulated: once per policy on `simulated_engine` with the machine's profile, the same scheduler
  settings and KV pool, and the serving path (HTTP in and out, `sim/serving_path.py`) measured
  on the server itself from lone requests and its step trace.

Both sides are summarized by `bench.metrics.summarize` (docs/DESIGN.md's definitions); the error is
simulated / mean real - 1. The servers always write a step trace (`--step-trace`), which gives
the serving path and the step-level comparison (`sim/trace_compare.py`).
No torch here: the engine runs in the server, the profile (when none is given) in a child process.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.client import LoadClient, RunResult
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.request_stream import SYNTHETIC_ID_LOW, SYNTHETIC_ID_SPAN, synthetic_prompt_ids
from tokenslice.bench.server_counters import wait_idle
from tokenslice.bench.metrics import RequestRecord, percentile, summarize
from tokenslice.sim.serving_path import ServingPath
from tokenslice.sim.simulate import SIMULATE_MAX_BATCH_SIZE, ample_kv_blocks, simulate_run
from tokenslice.bench.sweep import ServerProcess, ServerSpec, warm_up
from tokenslice.sim.trace_compare import admission_summary, admissions, egress_samples, measure_path, \
    path_under_load, steps_between, trace_summary
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.workloads import WorkloadRequest, make_workload
from tokenslice.config import CacheConfig, ModelConfig, SchedulerConfig, field_from
from tokenslice.engine.step_trace import load_step_trace
from tokenslice.predict.cost import CostModel, load_cost_model

# The metrics both sides print: (results key, label).
TWIN_METRICS = (("mean_normalized_latency", "mean normalized latency (s/token)"),
                ("p95_normalized_latency", "p95 normalized latency (s/token)"),
                ("p99_normalized_latency", "p99 normalized latency (s/token)"),
                ("mean_ttft", "mean TTFT (s)"), ("p95_ttft", "p95 TTFT (s)"), ("p99_ttft", "p99 TTFT (s)"),
                ("mean_tbt", "mean TBT (s)"), ("p95_tbt", "p95 TBT (s)"), ("p99_tbt", "p99 TBT (s)"))
# Lone requests sent one after another to measure the serving path (prompt, output tokens).
PATH_PROBES = 8
PATH_PROBE_LENGTHS = (16, 8)
# The SLO the policies are configured with on both sides: the paper protocol's 10x decode step.
SLO_DECODE_FACTOR = 10


@dataclass
class TwinSpec:
    """What `tokenslice twin` replays; the CLI flags map one to one onto these fields."""

    model: str  # served model (Hugging Face directory or builtin:tiny); with `url`, only a label
    policies: list[str]
    workload: str = "alpaca"
    rate: float | None = None  # arrival rate (req/s) ...
    load: float | None = None  # ... or a fraction of the real engine's fcfs saturation throughput
    saturation_rps: float | None = None  # with `load`: known saturation (None: measured over HTTP first)
    cv: float = 1.0
    num_requests: int = 100
    seed: int = 0
    repeats: int = 3
    profile: str | None = None  # cost model JSON; None: `tokenslice profile` runs first
    # The simulator's clock, when not `profile` (e.g. one fitted on step traces); the policies on
    # both sides keep `profile`, as the servers were given it.
    sim_profile: str | None = None
    dtype: str = field_from(ModelConfig, "dtype")
    max_batch_size: int = field_from(SchedulerConfig, "max_batch_size", default=SIMULATE_MAX_BATCH_SIZE)
    max_tokens_per_step: int = field_from(SchedulerConfig, "max_tokens_per_step")
    block_size: int = field_from(CacheConfig, "block_size")
    preemption: str = field_from(SchedulerConfig, "preemption")
    dataset: str | None = None
    tokenizer: str | None = None
    length_filter: bool = False
    max_prompt_len: int | None = None
    max_tokens_cap: int | None = None
    input_len: int = 128
    output_len: int = 128
    server_threads: int | None = 1  # torch threads in the server (one: immune to a busy neighbour)
    url: str | None = None  # an already running tokenslice server (one policy); None: start servers
    port: int | None = None  # the started servers' port (they run one at a time); None: a free port each
    server_step_trace: str | None = None  # with `url`: the file its --step-trace writes (None: no step data)
    step_trace_dir: str | None = None  # keep the servers' step traces here (None: a temporary directory)
    serving_path: bool = True  # model the HTTP path in the simulator (False: the bare engine)
    # The serving path, when known (e.g. measured under load on a calibration run with
    # `path_under_load`); None: probed on each server with lone requests.
    ingress_s: float | None = None
    egress_s: float | None = None
    ingress_gap_s: float = 0.0  # with them: the API server's time per request (ServingPath)
    egress_per_token_s: float = 0.0  # with them: egress per token its step emitted (ServingPath)
    warmup_requests: int = 8

    def validate(self) -> None:
        if (self.rate is None) == (self.load is None):
            raise ValueError("give exactly one of rate (--rate) or load (--load)")
        x = self.rate if self.rate is not None else self.load
        if not (x is not None and x > 0 and math.isfinite(x)):
            raise ValueError(f"rate/load must be a positive number, got {x}")
        if not self.policies:
            raise ValueError("give at least one policy")
        if self.url is not None and len(self.policies) != 1:
            raise ValueError("against a given --url there is one server: give its one policy in --policy")
        if self.repeats < 1 or self.num_requests < 1:
            raise ValueError("repeats and num_requests must be >= 1")

    def make(self, rate: float | None, cv: float, cache: DatasetCache, salt: int = 0) -> list[WorkloadRequest]:
        """The trace, prompts as token ids of exactly each request's length, so that both sides
        compute the same tokens whatever the model's tokenizer. Ids are drawn at random per `salt`:
        no two prompts share a cached prefix, nor do the prompts of two real runs (each repeat has
        its own salt, or a later run would find an earlier one's KV in the prefix cache)."""
        reqs = make_workload(self.workload, num_requests=self.num_requests, rate=rate, cv=cv, seed=self.seed,
                             dataset=self.dataset, tokenizer=self.tokenizer, length_filter=self.length_filter,
                             max_prompt_len=self.max_prompt_len, max_tokens_cap=self.max_tokens_cap,
                             input_len=self.input_len, output_len=self.output_len, cache=cache)
        rng = np.random.default_rng([self.seed, salt])
        return [dataclasses.replace(r, prompt=None, prompt_token_ids=[int(t) for t in rng.integers(
            SYNTHETIC_ID_LOW, SYNTHETIC_ID_LOW + SYNTHETIC_ID_SPAN, max(1, r.prompt_len))]) for r in reqs]

    def server_args(self, profile: str, kv_blocks: int, slo: float, trace: str) -> list[str]:
        return ["--dtype", self.dtype, "--max-batch-size", str(self.max_batch_size), "--max-tokens-per-step",
                str(self.max_tokens_per_step), "--block-size", str(self.block_size), "--preemption", self.preemption,
                "--kv-cache-blocks", str(kv_blocks), "--host-kv-blocks", str(4 * kv_blocks), "--profile", profile,
                "--slo-normalized-latency", repr(slo), "--step-trace", trace,
                "--no-compile"]  # the profile's engine runs eager (`tokenslice profile`)

    def scheduler_config(self, policy: str, slo: float) -> SchedulerConfig:
        cfg = SchedulerConfig(policy=policy, preemption=self.preemption, max_batch_size=self.max_batch_size,
                              max_tokens_per_step=self.max_tokens_per_step, slo_normalized_latency=slo)
        cfg.validate()
        return cfg


ProgressFn = Callable[[str], None]


def profile_in_child(spec: TwinSpec, out: Path, max_context: int, from_trace: Sequence[Path] = (),
                     with_grid: str | None = None) -> None:
    """`tokenslice profile` for the served model, in a child process with the server's threads,
    up to the longest context the trace reaches; with `from_trace`, fitted on those step traces
    of the served model instead (`profile --from-trace`), and `with_grid`, on that grid profile's
    timed batches too."""
    env = dict(os.environ)
    if spec.server_threads is not None:
        env["OMP_NUM_THREADS"] = str(spec.server_threads)
    cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "profile", "--model", spec.model,
           "--dtype", spec.dtype, "--max-batch-size", str(spec.max_batch_size), "--max-context", str(max_context),
           "--out", str(out), "--quiet"]
    if from_trace:
        cmd += ["--block-size", str(spec.block_size), "--from-trace", *map(str, from_trace)]
        if with_grid:
            cmd += ["--with-grid", with_grid]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"tokenslice profile failed ({done.returncode}):\n{done.stderr[-3000:]}")


def spread(values: Sequence[float | None]) -> float | None:
    """Run-to-run spread: the largest relative distance of a repeat from the repeats' mean."""
    vals = [v for v in values if v is not None]
    if len(vals) != len(values) or not vals:
        return None
    mean = float(np.mean(vals))
    return max(abs(v - mean) for v in vals) / mean if mean else 0.0


def twin_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """summarize() plus the TBT percentiles it leaves out (p95)."""
    m = summarize(records)
    m["p95_tbt"] = percentile([g for r in records if r.finished for g in r.tbt], 95)
    return m


def _mean(values: Sequence[float | None]) -> float | None:
    return float(np.mean(values)) if values and all(v is not None for v in values) else None


def compare(real_runs: Sequence[Mapping[str, Any]], sim_runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: real mean over repeats, each repeat, spread; simulated mean (one simulation per
    real run, replaying its send times); relative error of the means."""
    out = {}
    for key, _ in TWIN_METRICS:
        vals = [r.get(key) for r in real_runs]
        mean, s = _mean(vals), _mean([r.get(key) for r in sim_runs])
        err = (s / mean - 1.0) if (s is not None and mean) else None
        out[key] = {"real": mean, "real_runs": vals, "real_spread": spread(vals), "sim": s, "error": err}
    return out


class TwinServer:
    """One policy's server (started here, or the given URL) with its step trace."""

    def __init__(self, spec: TwinSpec, policy: str, args: list[str], trace: Path) -> None:
        self.trace = trace
        self.server: ServerProcess | None = None
        if spec.url is None:
            self.server = ServerProcess(ServerSpec(model=spec.model, args=args, threads=spec.server_threads), policy,
                                        port=spec.port)
            self.server.wait_ready()
            url = self.server.url
        else:
            url = spec.url
        self.client = LoadClient(ClientConfig(base_url=url, send_expected_length=True, prompt_format="auto"))

    def run(self, trace: Sequence[WorkloadRequest]) -> RunResult:
        result = self.client.run(list(trace))
        wait_idle(self.client.cfg)
        failed = [r for r in result.records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed on the real engine: {failed[0].error}")
        return result

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def probe_path(side: TwinServer) -> ServingPath:
    """The serving path from lone requests: each request's send and first token against the step
    that computed its prompt (the only step running while it is alone)."""
    prompt, out = PATH_PROBE_LENGTHS
    records: list[tuple[float, ClientRecord]] = []
    for i in range(PATH_PROBES):
        res = side.run([WorkloadRequest(f"path-{i}", 0.0, None, prompt, out, prompt_token_ids=synthetic_prompt_ids(
            prompt, 1000 + i))])
        records.append((res.wall_start, res.records[0]))
    return measure_path(records, load_step_trace(side.trace))


@dataclass(frozen=True)
class TwinPoint:
    """One arrival process to replay: a load (fraction of fcfs saturation) or a rate, and a CV."""

    load: float | None = None
    rate: float | None = None
    cv: float = 1.0

    def label(self) -> str:
        x = f"load {self.load:g}" if self.load is not None else f"rate {self.rate:g} req/s"
        return f"{x}, CV {self.cv:g}"


def as_sent(trace: Sequence[WorkloadRequest], records: Sequence[ClientRecord]) -> list[WorkloadRequest]:
    """The trace with each request's arrival at the time the client really sent it (a busy
    client sends late), so that the simulator replays what the server saw."""
    sent = {r.request_id: r.arrival for r in records}
    return [dataclasses.replace(r, arrival_time=sent.get(r.request_id, r.arrival_time)) for r in trace]


def _simulate_point(spec: TwinSpec, policy: str, costs: tuple[CostModel, CostModel], trace: list[WorkloadRequest],
                    slo: float, kv_blocks: int, path: ServingPath, out: Path | None) -> list[RequestRecord]:
    """One simulation; `costs` = (the clock's cost model, the policies')."""
    if out is not None:
        out.unlink(missing_ok=True)
    records, _ = simulate_run(costs[0], trace, spec.scheduler_config(policy, slo), kv_blocks, spec.block_size,
                              4 * kv_blocks, path=path, step_trace=None if out is None else str(out),
                              policy_cost=costs[1], max_tokens_is_output=True)  # as the client sends it
    return records


def run_twin(spec: TwinSpec, progress: ProgressFn | None = None, cache: DatasetCache | None = None,
             points: Sequence[TwinPoint] | None = None) -> dict[str, Any]:
    """Replay the trace on both sides for every policy; a JSON-ready result (see module doc).
    `points` replays several arrival processes on each server (default: the spec's one); a load
    is a fraction of the fcfs saturation throughput measured on the first server (all requests at
    once) unless the spec gives it."""
    spec.validate()
    tick = progress or (lambda _m: None)
    cache = cache or DatasetCache()
    points = list(points or [TwinPoint(spec.load, spec.rate, spec.cv)])
    with tempfile.TemporaryDirectory(prefix="tokenslice-twin-") as tmp:
        trace_dir = Path(spec.step_trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        every = spec.make(None, 1.0, cache)
        profile = spec.profile
        if profile is None:
            profile = str(trace_dir / "profile.json")
            tick("profiling the model (tokenslice profile)")
            # A power of two past the longest request: the grid's context points cover the trace.
            longest = max(r.prompt_len + r.output_len for r in every)
            profile_in_child(spec, Path(profile), max(64, 1 << longest.bit_length()))
        cost = load_cost_model(profile)
        costs = (load_cost_model(spec.sim_profile) if spec.sim_profile else cost, cost)
        slo = SLO_DECODE_FACTOR * cost.min_iteration_seconds()
        kv_blocks = ample_kv_blocks(every, spec.max_batch_size, spec.block_size)
        saturation = spec.saturation_rps
        saturation_window: tuple[float, float] | None = None  # when measured here: its run's wall clock
        results: list[dict[str, Any]] = [{"point": dataclasses.asdict(p), "policies": {}} for p in points]
        paths: dict[str, dict[str, float]] = {}
        for policy in spec.policies:
            step_file = Path(spec.server_step_trace) if spec.url else trace_dir / f"{policy}.steps.jsonl"
            if spec.url is None:
                step_file.unlink(missing_ok=True)
            has_steps = spec.url is None or spec.server_step_trace is not None
            tick(f"{policy}: starting the server")
            side = TwinServer(spec, policy, spec.server_args(profile, kv_blocks, slo, str(step_file)), step_file)
            try:
                warm_up(side.client, spec.warmup_requests)
                if not spec.serving_path:
                    path = ServingPath()
                elif spec.ingress_s is not None and spec.egress_s is not None:
                    path = ServingPath(spec.ingress_s, spec.egress_s, spec.ingress_gap_s, spec.egress_per_token_s)
                else:
                    path = probe_path(side) if has_steps else ServingPath()
                paths[policy] = dataclasses.asdict(path)
                if saturation is None and any(p.rate is None for p in points):
                    tick(f"{policy}: measuring saturation (all {spec.num_requests} requests at once)")
                    burst = spec.make(None, 1.0, cache, salt=spec.repeats)
                    res = side.run(burst)
                    saturation = twin_metrics(res.records)["throughput_rps"]
                    saturation_window = (res.wall_start, res.wall_start + res.duration_s)
                for i, point in enumerate(points):
                    rate = point.rate if point.rate is not None else (point.load or 0.0) * (saturation or 0.0)
                    runs, sims, windows = [], [], []
                    sim_file = trace_dir / f"{policy}.point{i}.sim-steps.jsonl"
                    for k in range(spec.repeats):  # same lengths and arrivals, fresh prompt ids (salt)
                        tick(f"{policy}, {point.label()}: real run {k + 1}/{spec.repeats}")
                        # No salt twice on one server (the saturation burst has `repeats`): a run
                        # would find an earlier one's prompts in the prefix cache, the simulator not.
                        trace = spec.make(rate, point.cv, cache, salt=k + i * (spec.repeats + 1))
                        res = side.run(trace)
                        runs.append(twin_metrics(res.records))
                        windows.append((res.wall_start, res.wall_start + res.duration_s))
                        # The simulator replays each run as the client really sent it.
                        sim_records = _simulate_point(spec, policy, costs, as_sent(trace, res.records), slo,
                                                      kv_blocks, path, sim_file if k == 0 else None)
                        sims.append(twin_metrics(sim_records))
                        if k == 0:
                            first_run = (res, sim_records)
                    steps = load_step_trace(step_file) if has_steps else []
                    sim_steps = load_step_trace(sim_file)
                    res, sim_records = first_run
                    ids = {r.request_id: r.response_id for r in res.records if r.response_id}
                    real_adm = admissions(res.records, res.wall_start, steps, ids)
                    results[i]["rate"] = rate
                    results[i]["policies"][policy] = {
                        "metrics": compare(runs, sims), "serving_path": paths[policy],
                        "windows": windows,
                        "steps": {"real": [trace_summary(steps_between(steps, a, b)) for a, b in windows],
                                  "sim": trace_summary(sim_steps)},
                        # The first run, request by request: send -> the step running its prompt -> first token.
                        "admission": {"real": admission_summary(real_adm),
                                      "sim": admission_summary(admissions(sim_records, 0.0, sim_steps)),
                                      "path_under_load": dataclasses.asdict(path_under_load(real_adm))
                                      if real_adm else None,
                                      # (tokens the step emitted, its end to the client's token): fit_egress
                                      "egress_samples": egress_samples(real_adm)}}
            finally:
                side.stop()
        return {"tool": "twin", "model": spec.model, "profile": profile if spec.profile else cost.name,
                "profile_file": profile, "sim_profile": costs[0].name, "spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "policies"},
                "saturation_rps": saturation, "saturation_window": saturation_window,
                "num_requests": spec.num_requests, "slo_normalized_latency": slo,
                "kv_cache_blocks": kv_blocks, "step_trace_dir": spec.step_trace_dir, "points": results}


def format_twin(result: Mapping[str, Any]) -> str:
    """One table per point and policy: real (mean over repeats, spread) vs simulated, and the error."""
    sat = result.get("saturation_rps")
    lines = [f"twin: {result['model']}, {result['num_requests']} requests per run, profile {result['profile']}"
             + (f", fcfs saturation {sat:.3g} req/s" if sat else "")]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    def pct(v: float | None, sign: bool = True) -> str:
        return "-" if v is None else f"{100 * v:+.1f}%" if sign else f"{100 * v:.1f}%"

    for point in result["points"]:
        label = TwinPoint(**point["point"]).label()
        for policy, data in point["policies"].items():
            path = data["serving_path"]
            lines.append(f"\n{policy}, {label} ({point['rate']:.3g} req/s); serving path in "
                         f"{1e3 * path['ingress_s']:.2f} ms, out {1e3 * path['egress_s']:.2f} ms "
                         f"+ {1e6 * path.get('egress_per_token_s', 0.0):.1f} us per token streamed")
            lines.append(f"  {'metric':36} {'real':>10} {'spread':>8} {'simulated':>10} {'error':>8}")
            for key, name in TWIN_METRICS:
                m = data["metrics"][key]
                lines.append(f"  {name:36} {num(m['real']):>10} {pct(m['real_spread'], False):>8} "
                             f"{num(m['sim']):>10} {pct(m['error']):>8}")
            real, sim = data["steps"]["real"], data["steps"]["sim"]
            if real and all(r.get("steps") for r in real):
                lines.append("  steps (real / simulated): " + ", ".join(
                    f"{k} {num(float(np.mean([r[k] for r in real if r[k] is not None] or [np.nan])))} / {num(sim[k])}"
                    for k in sim))
            adm = data.get("admission", {})
            if adm.get("real", {}).get("requests") and adm.get("sim", {}).get("requests"):
                lines.append("  first run, per request (real / simulated): " + ", ".join(
                    f"{k} {num(adm['real'][k])} / {num(adm['sim'][k])}" for k in adm["sim"] if k != "requests"))
                if adm.get("path_under_load"):
                    under = adm["path_under_load"]
                    lines.append(f"  serving path under this load (real): in {1e3 * under['ingress_s']:.2f} ms, "
                                 f"out {1e3 * under['egress_s']:.2f} ms + "
                                 f"{1e6 * under['egress_per_token_s']:.1f} us per token streamed")
    return "\n".join(lines)


__all__ = ["TWIN_METRICS", "TwinSpec", "TwinPoint", "TwinServer", "run_twin", "format_twin", "compare", "spread", "twin_metrics",
           "profile_in_child", "probe_path", "as_sent"]
