"""Simulated sweeps: policies x arrival rates (or loads) on the simulator (docs/DESIGN.md, "Benchmark protocols").

The logic behind `tokenslice simulate`, reusable by benchmark scripts:

- `simulate_run` replays one workload on `simulated_engine` (sim/engine.py) and returns per-request records plus
  engine-wide counters;
- `fcfs_saturation_rps` measures the saturation throughput the steady-state protocol's loads are
  fractions of (the same workload, every request at t=0, under fcfs: N / makespan);
- `run_sweep` runs every (seed, rate or load, policy) and builds the docs/DESIGN.md results file;
- `predict_lengths` gives a workload's requests the output lengths a LengthPredictor expects
  from their prompt text (SweepSpec.length_predictor, for srpt-predicted).

No torch here: the simulator is plain Python (a length predictor, when asked for, imports it).
"""
from __future__ import annotations

import atexit
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.metrics import SLO, RequestRecord, per_request_data, max_rate_detail, results_file, run_entry, run_key, \
    summarize, sweep_summary, user_summary
from tokenslice.bench.record_state import StateRecorder
from tokenslice.sim.serving_path import ServingPath
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.priority_patterns import PRIORITY_PATTERNS, PriorityPattern, PriorityUpdates
from tokenslice.bench.workloads import (WorkloadRequest, check_user_shares, make_workload, parse_user_shares,
                                        workload_stats)
from tokenslice.config import CacheConfig, SchedulerConfig, field_from
from tokenslice.predict.cost import CostModel
from tokenslice.request import Request

# "Ample" KV when none is given: at least this many tokens per batch slot (the brief's floor) ...
AMPLE_TOKENS_PER_SLOT = 4096
# Host KV tier of the swap modes when none is given: this many times the device pool.
HOST_KV_FACTOR = 4
# Sweeps batch at most 16 requests, not serve's SchedulerConfig.max_batch_size: the setup of the
# scheduling benchmarks (docs/benchmarks/scheduling-simulated.md), where the batch fills at moderate load and the policies'
# order matters (below the batch size every live job runs every step).
SIMULATE_MAX_BATCH_SIZE = 16
# --record-state: at most one snapshot every this many simulated seconds per run (a live view's
# refresh; a paper-scale run spans minutes to hours of virtual time).
RECORD_STATE_INTERVAL_S = 1.0
# SchedulerConfig fields a SweepSpec also has but does not hand to the scheduler: the SLO is
# resolved against the cost model per sweep, and the length predictor is applied to the workload
# up front (predict_lengths); async scheduling is applied to the simulator's clock (simulated_engine).
_NOT_SCHEDULER_SETTINGS = frozenset({"slo_normalized_latency", "length_predictor", "async_scheduling"})


@dataclass
class SweepSpec:
    """Everything a sweep varies or fixes; the CLI flags map one to one onto these fields.

    A field named like a SchedulerConfig or CacheConfig field is that setting, declared with its
    default (field_from) unless the sweep deliberately differs (max_batch_size, and the pool
    sizes, whose None means "ample" and "HOST_KV_FACTOR x the device pool" here)."""

    workload: str
    policies: list[str]
    preemption: str = field_from(SchedulerConfig, "preemption")
    rates: list[float] | None = None  # arrival rates (req/s) ...
    loads: list[float] | None = None  # ... or fractions of fcfs's saturation throughput
    cv: float = 1.0
    seeds: list[int] = field(default_factory=lambda: [0])
    num_requests: int = 1000
    max_batch_size: int = field_from(SchedulerConfig, "max_batch_size", default=SIMULATE_MAX_BATCH_SIZE)
    max_tokens_per_step: int = field_from(SchedulerConfig, "max_tokens_per_step")
    kv_cache_blocks: int | None = None  # None: ample (memory never binds)
    host_kv_blocks: int | None = None  # swap modes; None: HOST_KV_FACTOR x the device pool
    offload_dtype: str = field_from(CacheConfig, "offload_dtype")
    enable_prefix_caching: bool = field_from(CacheConfig, "enable_prefix_caching")  # real token ids only
    block_groups: bool = field_from(CacheConfig, "block_groups")
    async_scheduling: bool = False  # the loop's time overlaps the device's (SimulatedEngine.overlap_loop)
    burst_reserve_jobs: int = field_from(SchedulerConfig, "burst_reserve_jobs")
    burst_reserve_queues: int = field_from(SchedulerConfig, "burst_reserve_queues")
    eviction_amortization: float = field_from(SchedulerConfig, "eviction_amortization")
    srpt_aging: float = field_from(SchedulerConfig, "srpt_aging")
    stall_guard: str = field_from(SchedulerConfig, "stall_guard")
    delivery_rate: float = field_from(SchedulerConfig, "delivery_rate")
    max_stall_ms: float | None = field_from(SchedulerConfig, "max_stall_ms")
    block_size: int = field_from(CacheConfig, "block_size")
    slo_normalized_latency: float | None = None  # None: 10x the decode iteration time
    starvation_limit_s: float | None = field_from(SchedulerConfig, "starvation_limit_s")
    mlfq_quantum_ratio: float = field_from(SchedulerConfig, "mlfq_quantum_ratio")
    mlfq_num_queues: int = field_from(SchedulerConfig, "mlfq_num_queues")
    vtc_input_weight: float = field_from(SchedulerConfig, "vtc_input_weight")
    vtc_output_weight: float = field_from(SchedulerConfig, "vtc_output_weight")
    vtc_weights: str | None = field_from(SchedulerConfig, "vtc_weights")
    dataset: str | None = None
    tokenizer: str | None = None
    io_ratio: float | None = None
    length_filter: bool = False
    max_tokens_cap: int | None = None
    max_prompt_len: int | None = None
    # A `tokenslice predictor build` directory: every request with prompt text gets
    # predicted_output_tokens from it (predict_lengths). Build it on records disjoint from the
    # ones the workload draws, or the predictions leak the outputs.
    length_predictor: str | None = None
    num_users: int | None = None  # requests spread uniformly over this many users (fairness metrics)
    user_shares: str | None = None  # "10,1,1,1": each request's user drawn by these shares (one heavy user)
    # FastSwitch §4: priorities from a pattern, at arrival and every 1/f steps (None: no updates).
    priority_pattern: str | None = field(default=None, metadata={"choices": PRIORITY_PATTERNS})
    priority_update_freq: float = field_from(PriorityPattern, "update_freq")
    priority_levels: int = field_from(PriorityPattern, "levels")
    # JSON-lines file of scheduler snapshots on the virtual clock (bench/record_state.py); None: off.
    record_state: str | None = None
    record_state_interval_s: float = RECORD_STATE_INTERVAL_S

    def validate(self) -> None:
        if (self.rates is None) == (self.loads is None):
            raise ValueError("give exactly one of rates (--rates) or loads (--loads)")
        points = self.rates if self.rates is not None else self.loads
        if not points or any(not (x > 0 and math.isfinite(x)) for x in points):
            raise ValueError(f"rates/loads must be positive finite numbers, got {points}")
        if not self.policies:
            raise ValueError("give at least one policy")
        if not self.seeds:
            raise ValueError("give at least one seed")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        if self.length_predictor is not None and not (Path(self.length_predictor) / "predictor.json").is_file():
            raise ValueError(f"no length predictor in {self.length_predictor!r}; build one with "
                             "`tokenslice predictor build`")
        if not (self.record_state_interval_s > 0 and math.isfinite(self.record_state_interval_s)):
            raise ValueError(f"record_state_interval_s must be a positive number, got {self.record_state_interval_s}")
        if self.num_users is not None and self.num_users < 1:
            raise ValueError(f"num_users must be >= 1, got {self.num_users}")
        if self.user_shares is not None:
            check_user_shares(parse_user_shares(self.user_shares), self.num_users)
        pattern = self.priority(0)
        if pattern is not None:
            pattern.validate()

    @property
    def sweep(self) -> str:
        return "load" if self.loads is not None else "rate"

    def scheduler_config(self, policy: str, slo: float) -> SchedulerConfig:
        """The scheduler every run of `policy` gets: this spec's scheduler settings (its fields
        named like SchedulerConfig's), the resolved SLO, and the defaults for the rest."""
        mine = {f.name for f in dataclasses.fields(self)} - _NOT_SCHEDULER_SETTINGS
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig) if f.name in mine}
        # No engine-side length predictor: the simulator's predictions come with the workload.
        cfg = dataclasses.replace(SchedulerConfig(), policy=policy, slo_normalized_latency=slo, length_predictor=None,
                                  **settings)
        cfg.validate()
        return cfg

    def priority(self, seed: int) -> PriorityPattern | None:
        """The run's priority pattern (seeded like its workload), or None without one."""
        if self.priority_pattern is None:
            return None
        return PriorityPattern(self.priority_pattern, self.priority_update_freq, self.priority_levels, seed)

    def host_blocks(self, kv_cache_blocks: int) -> int:
        """The host tier's size (swap modes) next to a device pool of `kv_cache_blocks`."""
        return HOST_KV_FACTOR * kv_cache_blocks if self.host_kv_blocks is None else self.host_kv_blocks

    def make(self, seed: int, rate: float | None, cache: DatasetCache) -> list[WorkloadRequest]:
        reqs = make_workload(self.workload, num_requests=self.num_requests, rate=rate, cv=self.cv, seed=seed,
                             dataset=self.dataset, tokenizer=self.tokenizer, io_ratio=self.io_ratio,
                             length_filter=self.length_filter, max_tokens_cap=self.max_tokens_cap,
                             max_prompt_len=self.max_prompt_len, num_users=self.num_users,
                             user_shares=parse_user_shares(self.user_shares) if self.user_shares else None, cache=cache)
        return predict_lengths(reqs, self.length_predictor) if self.length_predictor else reqs


# ---------------------------------------------------------------- predicted output lengths

_PREDICTORS: dict[str, Any] = {}  # resolved directory -> LengthPredictor, open for the process
_PREDICTIONS: dict[tuple[str, str], int] = {}  # (directory, prompt text) -> predicted tokens


def _predictor(path: str | Path) -> tuple[str, Any]:
    key = str(Path(path).resolve())
    if key not in _PREDICTORS:
        from tokenslice.predict.length import LengthPredictor  # torch and faiss: only when asked for

        try:
            pred = LengthPredictor.load(key, background_training=False)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        _PREDICTORS[key] = pred
        atexit.register(pred.close)
    return key, _PREDICTORS[key]


def predict_lengths(requests: Sequence[WorkloadRequest], length_predictor: str | Path) -> list[WorkloadRequest]:
    """Copies of `requests` whose predicted_output_tokens is the predictor's answer for their
    prompt text (rounded, at least 1), as the engine predicts at arrival (ALISE §3.1). A request
    without text (synthetic, or a prompt rescaled or truncated away from its text) or with a
    prediction already keeps what it has; srpt-predicted then falls back to the mean output so far.

    The predictor is static here: a simulated finish is not fed back (`observe`), since a
    workload drawn with replacement repeats prompts, and learning their true lengths online would
    leak them. So each prompt's prediction is fixed, and new prompts are predicted in one batch
    and cached per (directory, prompt) for the life of the process."""
    key, pred = _predictor(length_predictor)
    todo = list(dict.fromkeys(r.prompt for r in requests if r.prompt is not None
                              and r.predicted_output_tokens is None and (key, r.prompt) not in _PREDICTIONS))
    if todo:
        for text, length in zip(todo, pred.predict(todo), strict=True):
            _PREDICTIONS[(key, text)] = max(1, round(length))
    return [r if r.prompt is None or r.predicted_output_tokens is not None
            else dataclasses.replace(r, predicted_output_tokens=_PREDICTIONS[(key, r.prompt)]) for r in requests]


# ---------------------------------------------------------------- one run

def records_from_requests(reqs: Sequence[Request]) -> list[RequestRecord]:
    """Client-view records of simulated (or real) engine requests, with the server-side counters.

    queue_s = e2e - exec_s - swap stall; exec_s = the step times of every iteration the request
    ran in (MLFQ's attained service).
    """
    out = []
    for r in reqs:
        m = r.metrics
        finished = m.finish_time is not None and r.finish_reason != "abort"
        stall = m.swap_stall_s
        e2e = (m.finish_time - m.arrival_time) if m.finish_time is not None else 0.0
        out.append(RequestRecord(
            request_id=r.request_id, arrival=m.arrival_time, prompt_tokens=r.num_prompt_tokens,
            output_tokens=r.num_output_tokens, first_token_time=m.token_times[0] if m.token_times else None,
            token_times=list(m.token_times), finish_time=m.finish_time, ok=finished,
            error=None if finished else (r.finish_reason or "unfinished"), user=r.user, priority=r.priority,
            preemptions=m.preemptions, started_preemptions=m.started_preemptions, recomputed_tokens=m.recomputed_tokens,
            swap_out_bytes=m.swap_out_bytes, swap_in_bytes=m.swap_in_bytes, swap_ops=m.swap_ops, swap_stall_s=stall,
            # Clamped: float sums of step times can overshoot e2e by an ulp.
            queue_s=max(0.0, e2e - m.exec_s - stall), exec_s=m.exec_s))
    return out


def engine_counters(engine: Any) -> dict[str, Any]:
    """Engine-wide counters that the per-request sums do not give (KV pressure, steps)."""
    sched = engine.scheduler
    kv = sched.kv
    return {"num_steps": engine.num_steps, "kv_blocks": kv.device.num_blocks,
            "kv_peak_blocks": kv.device.peak_used,
            "kv_peak_fraction": kv.device.peak_used / kv.device.num_blocks if kv.device.num_blocks else 0.0,
            "host_blocks": kv.host.num_blocks, "host_peak_blocks": kv.host.peak_used,
            "swap_fallbacks": sched.stats.swap_fallbacks}


def check_fits(requests: Sequence[WorkloadRequest], kv_cache_blocks: int, block_size: int) -> None:
    """Every request must fit the KV pool alone, or the simulator would cut or refuse it."""
    need = max((-(-(r.prompt_len + r.output_len) // block_size) for r in requests), default=0)
    if need > kv_cache_blocks:
        raise ValueError(f"a request needs {need} KV blocks of {block_size} tokens but the pool has "
                         f"{kv_cache_blocks}; raise --kv-cache-blocks or use --length-filter / --max-tokens-cap")


def simulate_run(cost: CostModel, workload_requests: Sequence[WorkloadRequest], sched_config: SchedulerConfig,
                 kv_cache_blocks: int, block_size: int = CacheConfig.block_size, host_kv_blocks: int | None = None,
                 offload_dtype: str = CacheConfig.offload_dtype, length_predictor: str | Path | None = None,
                 priority: PriorityPattern | None = None,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 block_groups: bool = CacheConfig.block_groups, state_recorder: StateRecorder | None = None,
                 path: ServingPath | None = None, step_trace: str | None = None,
                 policy_cost: CostModel | None = None, max_tokens_is_output: bool = False,
                 async_scheduling: bool = False) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Replay a workload on the simulator: (per-request records, engine-wide counters). The host
    tier (swap modes only) defaults to HOST_KV_FACTOR x the device pool. With `length_predictor`, requests
    without a prediction get one first (predict_lengths). With `priority`, requests get priorities
    from the pattern at arrival and every 1/f steps (FastSwitch §4). `state_recorder` snapshots the
    scheduler as the virtual clock advances (it only reads, so the results do not change). `path`
    adds the serving path outside the engine (HTTP in and out, sim/serving_path.py): the records
    are then what a client would see. `step_trace` writes every simulated step as the real engine's
    --step-trace does (virtual-clock starts); it turns off fast-forward, which changes no result.
    `policy_cost`: the cost model the policies see, when it is not the clock's. `max_tokens_is_output`:
    requests carry max_tokens = their output length, as an HTTP load client sends (sim/replay.py)."""
    from tokenslice.sim.engine import simulated_engine  # the engine pulls in the scheduler stack: import on use
    from tokenslice.sim.replay import replay

    check_fits(workload_requests, kv_cache_blocks, block_size)
    if length_predictor is not None:
        workload_requests = predict_lengths(workload_requests, length_predictor)
    host = HOST_KV_FACTOR * kv_cache_blocks if host_kv_blocks is None else host_kv_blocks
    engine = simulated_engine(sched_config, cost, kv_cache_blocks=kv_cache_blocks, block_size=block_size,
                              host_kv_blocks=host, offload_dtype=offload_dtype,
                              enable_prefix_caching=enable_prefix_caching, block_groups=block_groups,
                              policy_cost=policy_cost, async_scheduling=async_scheduling)
    if step_trace is not None:
        from tokenslice.engine.step_trace import StepTraceWriter

        engine.step_trace = StepTraceWriter(step_trace)
        engine.fast_forward = False  # every step is written (bulk repeats are exact, but not steps)
    observe: Callable[[float], None] | None = None
    if state_recorder is not None:
        observe = lambda now: state_recorder.observe(engine.scheduler, now)  # noqa: E731
    path = path or ServingPath()
    delays = path.ingress_delays(workload_requests) if not path.is_zero else None
    reqs = replay(engine, path.to_engine(workload_requests),
                  priority_updates=PriorityUpdates(priority) if priority is not None else None,
                  on_advance=observe, max_tokens_is_output=max_tokens_is_output)
    engine.close()
    return path.to_client(records_from_requests(reqs), delays), engine_counters(engine)


def ample_kv_blocks(requests: Sequence[WorkloadRequest], max_batch_size: int,
                    block_size: int = CacheConfig.block_size) -> int:
    """KV blocks that never bind: every request of the workload resident at once (a preemptive
    policy may start them all), and at least max_batch_size x 4096 tokens."""
    every = sum(-(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    return max(every, -(-max_batch_size * AMPLE_TOKENS_PER_SLOT // block_size))


def fcfs_saturation_rps(cost: CostModel, workload_requests: Sequence[WorkloadRequest],
                        sched_config: SchedulerConfig, kv_cache_blocks: int,
                        block_size: int = CacheConfig.block_size, async_scheduling: bool = False) -> float:
    """Throughput (req/s) of fcfs with every request arriving at t=0: N / makespan."""
    at_once = [dataclasses.replace(r, arrival_time=0.0) for r in workload_requests]
    cfg = dataclasses.replace(sched_config, policy="fcfs")
    records, _ = simulate_run(cost, at_once, cfg, kv_cache_blocks, block_size, async_scheduling=async_scheduling)
    span = max(r.finish_time for r in records if r.finish_time is not None)
    return len(records) / span if span > 0 else math.inf


def run_metrics(records: Sequence[RequestRecord], counters: Mapping[str, Any],
                slo: SLO | float | None) -> dict[str, Any]:
    """summarize() plus the latency breakdown (FastServe Fig. 15(b)): mean queueing, execution and
    swap-stall seconds per request (queue_s and exec_s are already per-request means)."""
    m = summarize(records, slo=slo)
    m.update(counters)
    n = len(records)
    m["mean_queue_s"] = m["queue_s"]
    m["mean_exec_s"] = m["exec_s"]
    m["mean_swap_s"] = m["swap_stall_s"] / n if n else 0.0
    return m


# ---------------------------------------------------------------- the sweep

def mean_by_point(runs: Sequence[Mapping[str, Any]], x_key: str, metric: str) -> dict[str, list[tuple[float, float | None]]]:
    """Per run key, (x, metric averaged over seeds) sorted by x; None when any seed lacks it."""
    groups: dict[str, dict[float, list[float | None]]] = {}
    for run in runs:
        x = run.get(x_key)
        if x is None:
            continue
        groups.setdefault(run_key(run, runs), {}).setdefault(float(x), []).append(run["metrics"].get(metric))
    return {k: [(x, None if any(v is None for v in vals) else float(np.mean(vals)))
                for x, vals in sorted(pts.items())] for k, pts in groups.items()}


def summary_for(runs: Sequence[Mapping[str, Any]], spec: SweepSpec, slo: float,
                saturation: Mapping[int, float]) -> dict[str, Any]:
    """max rate under the SLO per policy (seeds averaged per point), plus saturation and loads."""
    x_key = spec.sweep
    sat_mean = float(np.mean(list(saturation.values()))) if saturation else None
    points = mean_by_point(runs, x_key, "mean_normalized_latency")
    # sweep_summary takes runs; give it one seed-averaged pseudo-run per point.
    pseudo = []
    for key, pts in points.items():
        policy, _, preemption = key.partition("/")
        for x, v in pts:
            rate = x if x_key == "rate" else x * (sat_mean or 0.0)
            pseudo.append({"policy": key, "preemption": preemption or spec.preemption, "rate": rate,
                           "metrics": {"mean_normalized_latency": v}})
    summ = sweep_summary(pseudo, slo, fcfs_saturation_rps=sat_mean)
    summ["fcfs_saturation_rps_by_seed"] = {str(s): v for s, v in saturation.items()}
    if x_key == "load":
        detail = {k: max_rate_detail([p[0] for p in pts], [p[1] for p in pts], slo) for k, pts in points.items()}
        summ["max_load_under_slo"] = {k: d.rate for k, d in detail.items()}
        summ["max_load_censored"] = sorted(k for k, d in detail.items() if d.censored)
    return summ


def run_sweep(cost: CostModel, spec: SweepSpec, *, profile_name: str | None = None,
              cache: DatasetCache | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every (seed, rate or load, policy) on the simulator, as a docs/DESIGN.md results file.

    Each run keeps its per-request data under "per_request" (drop it before writing a compact
    file). `progress(description)` is called once per finished simulation, saturation runs
    included (there are `sweep_size(spec)` of them).
    """
    from tokenslice.sched.policy import PolicyContext
    from tokenslice.sched.registry import make_policy

    spec.validate()
    cache = cache or DatasetCache()
    slo = spec.slo_normalized_latency or 10 * cost.min_iteration_seconds()
    tick = progress or (lambda _desc: None)
    for policy in spec.policies:  # fail on a bad name before minutes of simulation, not after
        make_policy(policy, PolicyContext(spec.scheduler_config(policy, slo), cost))

    # The all-at-once workload per seed: its lengths match every rate's (independent streams), so
    # it sizes the ample KV pool and measures saturation.
    at_once = {seed: spec.make(seed, None, cache) for seed in spec.seeds}
    kv_blocks = spec.kv_cache_blocks or max(ample_kv_blocks(w, spec.max_batch_size, spec.block_size)
                                            for w in at_once.values())
    saturation: dict[int, float] = {}
    for seed, wl in at_once.items():
        saturation[seed] = fcfs_saturation_rps(cost, wl, spec.scheduler_config("fcfs", slo), kv_blocks,
                                               spec.block_size, spec.async_scheduling)
        tick(f"fcfs saturation seed={seed}")

    runs: list[dict[str, Any]] = []
    recorder = StateRecorder(spec.record_state, spec.record_state_interval_s) if spec.record_state else None
    try:
        for seed in spec.seeds:
            xs = spec.rates if spec.rates is not None else spec.loads
            for x in xs or []:
                rate = x if spec.sweep == "rate" else x * saturation[seed]
                load = x if spec.sweep == "load" else rate / saturation[seed]
                wl = spec.make(seed, rate, cache)
                for policy in spec.policies:
                    if recorder is not None:
                        recorder.start_run(policy=policy, preemption=spec.preemption, rate=rate, load=load, seed=seed)
                    records, counters = simulate_run(cost, wl, spec.scheduler_config(policy, slo), kv_blocks,
                                                     spec.block_size, spec.host_kv_blocks, spec.offload_dtype,
                                                     priority=spec.priority(seed),
                                                     enable_prefix_caching=spec.enable_prefix_caching,
                                                     block_groups=spec.block_groups, state_recorder=recorder,
                                                     async_scheduling=spec.async_scheduling)
                    metrics = run_metrics(records, counters, slo)
                    users = user_summary(records)
                    runs.append(run_entry(policy, spec.preemption, rate, metrics, load=load, cv=spec.cv,
                                          num_requests=len(wl), seed=seed, per_request=per_request_data(records),
                                          **({"per_user": users} if users else {})))
                    tick(f"{policy} {spec.sweep}={x:g} seed={seed}")
    finally:
        if recorder is not None:
            recorder.close()

    stats = workload_stats(next(iter(at_once.values())))
    workload = {"name": spec.workload, "dataset": spec.dataset, "tokenizer": spec.tokenizer,
                "num_requests": spec.num_requests, "cv": spec.cv, "seeds": list(spec.seeds), "sweep": spec.sweep,
                "rates": spec.rates, "loads": spec.loads, "io_ratio": spec.io_ratio,
                "length_filter": spec.length_filter, "max_tokens_cap": spec.max_tokens_cap,
                "max_prompt_len": spec.max_prompt_len, "length_predictor": spec.length_predictor,
                "num_users": spec.num_users, "user_shares": spec.user_shares, "priority_pattern": spec.priority_pattern,
                "priority_update_freq": spec.priority_update_freq if spec.priority_pattern else None,
                "priority_levels": spec.priority_levels if spec.priority_pattern else None,
                "prompt_mean": stats.get("prompt_mean"),
                "output_mean": stats.get("output_mean"),
                "scheduler": {"preemption": spec.preemption, "max_batch_size": spec.max_batch_size,
                              "max_tokens_per_step": spec.max_tokens_per_step, "kv_cache_blocks": kv_blocks,
                              "host_kv_blocks": spec.host_blocks(kv_blocks), "offload_dtype": spec.offload_dtype,
                              "enable_prefix_caching": spec.enable_prefix_caching,
                              "block_groups": spec.block_groups, "async_scheduling": spec.async_scheduling,
                              "burst_reserve_jobs": spec.burst_reserve_jobs,
                              "burst_reserve_queues": spec.burst_reserve_queues,
                              "eviction_amortization": spec.eviction_amortization,
                              "srpt_aging": spec.srpt_aging, "stall_guard": spec.stall_guard,
                              "delivery_rate": spec.delivery_rate, "max_stall_ms": spec.max_stall_ms,
                              "kv_cache_blocks_given": spec.kv_cache_blocks is not None,
                              "block_size": spec.block_size, "starvation_limit_s": spec.starvation_limit_s,
                              "mlfq_quantum_ratio": spec.mlfq_quantum_ratio,
                              "mlfq_num_queues": spec.mlfq_num_queues,
                              "vtc_input_weight": spec.vtc_input_weight,
                              "vtc_output_weight": spec.vtc_output_weight, "vtc_weights": spec.vtc_weights}}
    summary = summary_for(runs, spec, slo, saturation)
    return results_file("simulate", workload, profile_name or cost.name, SLO(mean_normalized_latency=slo),
                        runs, summary)


def sweep_size(spec: SweepSpec) -> int:
    """Simulations run_sweep does: one saturation run per seed, then every point x policy."""
    xs = spec.rates if spec.rates is not None else spec.loads
    return len(spec.seeds) * (1 + len(xs or []) * len(spec.policies))


def strip_per_request(results: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a results file without per-request data (the compact file `--out` writes)."""
    out = dict(results)
    out["runs"] = [{k: v for k, v in run.items() if k != "per_request"} for run in results["runs"]]
    return out


__all__ = ["HOST_KV_FACTOR", "SIMULATE_MAX_BATCH_SIZE", "RECORD_STATE_INTERVAL_S", "SweepSpec", "predict_lengths", "records_from_requests",
           "engine_counters", "check_fits", "simulate_run", "ample_kv_blocks", "fcfs_saturation_rps", "run_metrics",
           "per_request_data", "mean_by_point", "summary_for", "run_sweep", "sweep_size", "strip_per_request"]
