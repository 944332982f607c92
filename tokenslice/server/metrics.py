"""Prometheus metrics for the server, named `tokenslice:*` after vLLM's `vllm:*` where vLLM has
an equivalent (so existing dashboards need only the prefix changed).

Gauges and engine-wide counters are read at scrape time from the engine client's latest stats
snapshot (from the engine-core process, or the in-process loop); per-request histograms and
token counters are fed by `observe`, which the engine client calls for every output. Each app
gets its own CollectorRegistry (no global state).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenslice.engine.protocol import EngineStats
from tokenslice.request import RequestOutput
from tokenslice.server.latency_window import LatencyWindow

LABELS = ["model_name"]
USER_LABELS = ["model_name", "user"]
# Per-user series are labelled by the client's `user` string: past this many distinct users the
# rest share one series, and a long or unprintable one is cut to a prefix and a hash
# (user_label), so a client can grow the scrape neither by many users nor by long names.
MAX_METRIC_USERS = 100
MAX_USER_LABEL_CHARS = 64
# Per-tenant series are labelled by the tenant names of `serve --api-keys` (server/identity.py).
TENANT_LABELS = ["model_name", "tenant"]
OTHER_USERS = "_other"
NO_USER = "_none"
# Seconds; fine at the low end because CPU decode steps take milliseconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class _StatsCollector(Collector):
    """Gauges and engine-wide counters from the latest EngineStats snapshot."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], queued: Callable[[], int],
                 replicas: Callable[[], list[tuple[bool, int, EngineStats]]] | None = None) -> None:
        self.model_name = model_name
        self.stats = stats
        self.queued = queued
        self.replicas = replicas  # data parallelism: each replica's (alive, outstanding tokens, stats)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)  # exposed with a _total suffix
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield self._gauge("tokenslice:num_requests_running", "Requests in the batch of the last step.",
                          s.num_running)
        yield self._gauge("tokenslice:num_requests_waiting", "Requests that have never run (or must recompute).",
                          s.num_waiting)
        yield self._gauge("tokenslice:num_requests_preempted", "Requests paused by the scheduler after running.",
                          s.num_preempted)
        yield self._gauge("tokenslice:num_requests_swapped", "Requests whose KV cache is in host memory.",
                          s.num_swapped)
        yield self._gauge("tokenslice:num_requests_admission_queue",
                          "Requests admitted by the server that have no output yet (bounded by --max-waiting).",
                          self.queued())
        yield self._gauge("tokenslice:kv_cache_usage_perc", "Fraction of device KV blocks in use (1 = 100%).",
                          s.device_blocks_used / s.device_blocks_total if s.device_blocks_total else 0.0)
        yield self._gauge("tokenslice:cpu_cache_usage_perc", "Fraction of host (swap) KV blocks in use (1 = 100%).",
                          s.host_blocks_used / s.host_blocks_total if s.host_blocks_total else 0.0)
        yield self._gauge("tokenslice:kv_cache_num_blocks", "Device KV blocks in the pool.", s.device_blocks_total)
        c = s.scheduler
        yield self._counter("tokenslice:num_preemptions", "Requests preempted by the scheduler.", c.preemptions)
        yield self._counter("tokenslice:num_started_preemptions",
                            "Preemptions of streams that had sent a token (a reader may wait).", c.started_preemptions)
        yield self._counter("tokenslice:kv_swap_out_bytes", "KV bytes copied from device to host.", c.swap_out_bytes)
        yield self._counter("tokenslice:kv_swap_in_bytes", "KV bytes copied from host to device.", c.swap_in_bytes)
        yield self._counter("tokenslice:kv_swap_ops", "Copy operations (contiguous block runs) of KV swaps.", c.swap_ops)
        yield self._counter("tokenslice:num_recomputed_tokens", "Tokens recomputed after their KV was dropped.",
                            c.recomputed_tokens)
        yield self._counter("tokenslice:kv_swap_fallbacks", "Evictions that recomputed because host KV space was full.",
                            c.swap_fallbacks)
        yield self._counter("tokenslice:prefix_cache_queries",
                            "Prompt tokens of requests that looked up the prefix cache.", c.prefix_cache_queries)
        hits = CounterMetricFamily("tokenslice:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache, by tier (device, host).",
                                   labels=[*LABELS, "tier"])
        hits.add_metric([self.model_name, "device"], c.prefix_cache_device_hits)
        hits.add_metric([self.model_name, "host"], c.prefix_cache_host_hits)
        yield hits
        yield self._counter("tokenslice:engine_steps", "Engine steps taken (the live view shows the same number).",
                            s.num_steps)
        yield self._counter("tokenslice:engine_faults", "Engine steps that raised.", s.num_faults)
        if self.replicas is not None:
            yield from self._replica_gauges(self.replicas())

    def _replica_gauges(self, replicas: list[tuple[bool, int, EngineStats]]) -> Iterator[Metric]:
        """--data-parallel-size: each replica's series, labelled by its index (the others sum them)."""
        series = [("tokenslice:dp_replica_alive", "1 while the replica's engine runs.", lambda a, w, s: float(a)),
                  ("tokenslice:dp_replica_outstanding_tokens", "Tokens the router counts as left to compute.",
                   lambda a, w, s: w),
                  ("tokenslice:dp_replica_running", "Requests in the replica's batch.", lambda a, w, s: s.num_running),
                  ("tokenslice:dp_replica_waiting", "Requests waiting in the replica.", lambda a, w, s: s.num_waiting),
                  ("tokenslice:dp_replica_kv_cache_usage_perc", "Fraction of the replica's device KV blocks in use.",
                   lambda a, w, s: s.device_blocks_used / s.device_blocks_total if s.device_blocks_total else 0.0)]
        for name, doc, value in series:
            g = GaugeMetricFamily(name, doc, labels=[*LABELS, "replica"])
            for i, (alive, work, st) in enumerate(replicas):
                g.add_metric([self.model_name, str(i)], value(alive, work, st))
            yield g


def user_label(user: str) -> str:
    """The label of a client's `user`: itself if short and printable; else its printable prefix,
    "~" and 16 hex digits of its hash, MAX_USER_LABEL_CHARS in all."""
    if len(user) <= MAX_USER_LABEL_CHARS and user.isprintable():
        return user
    digest = hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    prefix = "".join(c for c in user[:MAX_USER_LABEL_CHARS - 17] if c.isprintable())
    return f"{prefix}~{digest}"


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], queued: Callable[[], int],
                 tenants: tuple[str, ...] = (),
                 replicas: Callable[[], list[tuple[bool, int, EngineStats]]] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("tokenslice:prompt_tokens", "Prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("tokenslice:generation_tokens", "Tokens generated.", LABELS, registry=r)
        self.request_success = Counter("tokenslice:request_success", "Finished requests by finish reason.",
                                       LABELS + ["finished_reason"], registry=r)
        self.rejected = Counter("tokenslice:request_rejected", "Requests answered with an error (4xx or 5xx), by HTTP status.",
                                LABELS + ["status"], registry=r)
        self.ttft = Histogram("tokenslice:time_to_first_token_seconds", "Time to first token (from arrival).",
                              LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("tokenslice:inter_token_latency_seconds", "Time between consecutive tokens (TBT).",
                             LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenslice:e2e_request_latency_seconds", "Arrival to finish.",
                             LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("tokenslice:request_queue_time_seconds", "Arrival to first scheduled.",
                                    LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.stall = Histogram("tokenslice:request_stall_seconds",
                               "Per finished request: time its reader, at the request's delivery rate, waited "
                               "for tokens after the first (docs/DESIGN.md, Stall guard).",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        # Per user (fair-share policies, FastSwitch / VTC): the service each user got and its latency.
        self.user_prompt_tokens = Counter("tokenslice:user_prompt_tokens", "Prefill tokens processed, per user.",
                                          USER_LABELS, registry=r)
        self.user_generation_tokens = Counter("tokenslice:user_generation_tokens", "Tokens generated, per user.",
                                              USER_LABELS, registry=r)
        self.user_e2e = Histogram("tokenslice:user_e2e_request_latency_seconds", "Arrival to finish, per user.",
                                  USER_LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self._users: set[str] = set()
        # Per tenant (`serve --api-keys`): service, latency, and requests refused by its limits.
        self.tenant_prompt_tokens = Counter("tokenslice:tenant_prompt_tokens", "Prefill tokens processed, per tenant.",
                                            TENANT_LABELS, registry=r)
        self.tenant_generation_tokens = Counter("tokenslice:tenant_generation_tokens", "Tokens generated, per tenant.",
                                                TENANT_LABELS, registry=r)
        self.tenant_e2e = Histogram("tokenslice:tenant_e2e_request_latency_seconds", "Arrival to finish, per tenant.",
                                    TENANT_LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.tenant_refusals = Counter("tokenslice:tenant_requests_limited",
                                       "Requests refused (429) by their tenant's limit, per tenant and limit.",
                                       TENANT_LABELS + ["limit"], registry=r)
        self._tenant_series = {t: (self.tenant_prompt_tokens.labels(model_name, t),
                                   self.tenant_generation_tokens.labels(model_name, t),
                                   self.tenant_e2e.labels(model_name, t)) for t in tenants}
        r.register(_StatsCollector(model_name, stats, queued, replicas))
        # The model-labelled series, looked up once: observe runs for every token of every stream.
        m = model_name
        self._generation_tokens, self._prompt_tokens = self.generation_tokens.labels(m), self.prompt_tokens.labels(m)
        self._ttft, self._tbt, self._e2e = self.ttft.labels(m), self.tbt.labels(m), self.e2e.labels(m)
        self._queue_time = self.queue_time.labels(m)
        self._stall = self.stall.labels(m)
        self._user_series: dict[str, tuple[Any, Any, Any]] = {}
        # The last minute's TTFT and TBT, for the live view (/v1/state).
        self.recent_ttft = LatencyWindow()
        self.recent_tbt = LatencyWindow()

    def _user_label(self, user: str | None) -> str:
        if user is None:
            return NO_USER
        label = user_label(user)
        if label in self._users:
            return label
        if len(self._users) < MAX_METRIC_USERS:
            self._users.add(label)
            return label
        return OTHER_USERS

    def _per_user(self, user: str | None) -> tuple[Any, Any, Any]:
        """(prompt tokens, generation tokens, e2e) series of a user's label."""
        label = self._user_label(user)
        series = self._user_series.get(label)
        if series is None:
            m = self.model_name
            series = (self.user_prompt_tokens.labels(m, label), self.user_generation_tokens.labels(m, label),
                      self.user_e2e.labels(m, label))
            self._user_series[label] = series
        return series

    def observe(self, out: RequestOutput) -> None:
        """Record one engine output, right after its step, while `out.metrics` (the request's
        record) is consistent."""
        m = out.metrics
        user_prompt, user_generation, user_e2e = self._per_user(out.user)
        tenant = self._tenant_series.get(out.tenant) if out.tenant is not None else None
        if out.new_token_ids:
            self._generation_tokens.inc(len(out.new_token_ids))
            user_generation.inc(len(out.new_token_ids))
            if tenant is not None:
                tenant[1].inc(len(out.new_token_ids))
            if m is not None and out.num_output_tokens == len(out.new_token_ids):  # its first token
                self._prompt_tokens.inc(out.num_prompt_tokens)
                user_prompt.inc(out.num_prompt_tokens)
                if tenant is not None:
                    tenant[0].inc(out.num_prompt_tokens)
                if m.ttft is not None:
                    self._ttft.observe(m.ttft)
                    self.recent_ttft.add(m.ttft)
                if m.first_scheduled_time is not None:
                    self._queue_time.observe(m.first_scheduled_time - m.arrival_time)
            elif m is not None and len(m.token_times) >= 2:
                tbt = m.token_times[-1] - m.token_times[-2]
                self._tbt.observe(tbt)
                self.recent_tbt.add(tbt)
        if out.finished:
            self.request_success.labels(self.model_name, out.finish_reason or "unknown").inc()
            if m is not None and m.e2e is not None:
                self._e2e.observe(m.e2e)
                user_e2e.observe(m.e2e)
                if tenant is not None:
                    tenant[2].observe(m.e2e)
            if m is not None and m.token_times:
                self._stall.observe(m.stall_s)

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def tenant_limited(self, tenant: str | None, limit: str) -> None:
        if tenant in self._tenant_series:
            self.tenant_refusals.labels(self.model_name, tenant, limit).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
