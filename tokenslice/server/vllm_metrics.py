"""Prometheus series under vLLM's own names (`vllm:*`, labels `model_name` and `engine`), next to
the `tokenslice:*` ones (server/metrics.py), so a dashboard or alert written for vLLM works
unchanged. Always on: a drop-in needs no flag, and the cost is a counter and a histogram update
per streamed token (the gauges are read at scrape time).

Names, label sets and buckets follow vLLM's Prometheus logger (vllm/v1/metrics/loggers.py).
Where the engines differ:
- num_requests_waiting counts waiting and preempted requests (vLLM puts preempted ones back in
  its waiting queue); num_requests_swapped those whose KV is in host memory.
- iteration_tokens_total: the tokens each engine step produced, counting a prompt at the step
  that produced its first token (prefill chunks before it are not seen here); steps are told
  apart by the time their tokens were stamped.
- prefix_cache_hits counts tokens found on the device; tokens found in host memory are
  tokenslice:prefix_cache_hits_total{tier="host"}.
- inter_token_latency_seconds is time_per_output_token_seconds under vLLM's newer name.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenslice.config import CacheConfig
from tokenslice.engine.protocol import EngineStats
from tokenslice.request import RequestOutput

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics(Collector):
    """The vLLM-named series of one server, in `registry`: histograms and token counters fed by
    `observe` (every engine output), gauges and engine counters read from `stats` at scrape time."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 stats: Callable[[], EngineStats], cache_info: dict[str, str] | None = None) -> None:
        self.values = [model_name, "0"]
        self.stats = stats
        self.cache_info = dict(cache_info or {})
        r = registry
        # Registered before the histograms: a scrape runs collect() (which ends the step being
        # counted) before it reads them.
        r.register(self)
        tokens = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.values)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     registry=r).labels(*self.values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r).labels(*self.values)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*LABELS, "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot_family = Histogram("vllm:time_per_output_token_seconds",
                                     "Histogram of time per output token in seconds.", LABELS, buckets=TPOT_BUCKETS,
                                     registry=r)
        self.tpot = self.tpot_family.labels(*self.values)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS)
        self._success: dict[str, Any] = {}
        # The engine step whose outputs are being counted: its token time and its tokens so far.
        self._step_time: float | None = None
        self._step_tokens = 0

    def observe(self, out: RequestOutput) -> None:
        """One engine output (called right after `ServerMetrics.observe`, from the same place)."""
        m = out.metrics
        new = len(out.new_token_ids)
        if new:
            self.generation_tokens.inc(new)
            step_tokens = new
            times = m.token_times if m is not None else []
            if out.num_output_tokens == new:  # its first token(s): the prompt was computed
                self.prompt_tokens.inc(out.num_prompt_tokens)
                step_tokens += out.num_prompt_tokens
                if m is not None and m.ttft is not None:
                    self.ttft.observe(m.ttft)
            for i in range(max(1, len(times) - new), len(times)):  # the gap before each new decode token
                self.tpot.observe(times[i] - times[i - 1])
            step = times[-1] if times else None
            if step != self._step_time:
                self._end_step()
                self._step_time = step
            self._step_tokens += step_tokens
        if out.finished:
            self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        reason = out.finish_reason or "abort"
        counter = self._success.get(reason)
        if counter is None:
            counter = self._success[reason] = self.request_success.labels(*self.values, reason)
        counter.inc()
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_output_tokens)
        m = out.metrics
        if m is None:
            return
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.first_scheduled_time is None:
            return
        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.token_times:
            first, last = m.token_times[0], m.token_times[-1]
            self.prefill_time.observe(first - m.first_scheduled_time)
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - m.first_scheduled_time)

    def _end_step(self) -> None:
        if self._step_tokens:
            self.iteration_tokens.observe(self._step_tokens)
        self._step_tokens = 0

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        """The scrape-time series. Outputs arrive a step at a time on the event loop that also
        answers /metrics, so the step being counted is complete here."""
        self._end_step()
        self._step_time = None
        s = self.stats()
        kv = s.device_blocks_used / s.device_blocks_total if s.device_blocks_total else 0.0
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s.num_waiting + s.num_preempted)
        yield self._gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)
        yield self._gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", kv)
        yield self._gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.",
                          s.host_blocks_used / s.host_blocks_total if s.host_blocks_total else 0.0)
        c = s.scheduler
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            c.preemptions)
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.", c.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            c.prefix_cache_device_hits)
        info = {**self.cache_info, "num_gpu_blocks": str(s.device_blocks_total),
                "num_cpu_blocks": str(s.host_blocks_total), "engine": "0"}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        yield g
        for family in self.tpot_family.collect():  # the same observations under vLLM's newer name
            itl = Metric("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         "histogram")
            itl.samples = [x._replace(name=x.name.replace(family.name, itl.name, 1)) for x in family.samples]
            yield itl


def cache_info_labels(cache: CacheConfig) -> dict[str, str]:
    """vllm:cache_config_info's labels from the cache settings (block counts are added at scrape time)."""
    return {"block_size": str(cache.block_size), "cache_dtype": "auto",
            "gpu_memory_utilization": str(cache.kv_memory_fraction or "auto"), "swap_space": str(cache.swap_space_gb),
            "enable_prefix_caching": str(cache.enable_prefix_caching), "cpu_offload_dtype": cache.offload_dtype}
