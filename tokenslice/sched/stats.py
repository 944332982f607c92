"""Scheduler counters: one object for the engine-wide totals, updated together with each
request's own counters (RequestMetrics), so the two never disagree. Prometheus, results files
and tests read it."""
from __future__ import annotations

from dataclasses import dataclass
from tokenslice.plan import Direction
from tokenslice.request import RequestMetrics


@dataclass
class SchedulerStats:
    preemptions: int = 0  # a running request paused: evicted, or left out of the next batch
    started_preemptions: int = 0  # of those, streams that had sent a token (a reader waits)
    recomputed_tokens: int = 0  # KV tokens dropped, to be computed again
    swap_out_bytes: int = 0  # device -> host, as moved over the link (int8-sized when offloaded so)
    swap_in_bytes: int = 0
    swap_ops: int = 0  # copy operations: contiguous block runs moved (plan.copy_runs)
    swap_fallbacks: int = 0  # evictions that recomputed because the host tier was full
    # Prefix cache (vLLM automatic prefix caching), in tokens: prompt tokens of requests that
    # started with a cache lookup, and those found cached on device or on host.
    prefix_cache_queries: int = 0
    prefix_cache_device_hits: int = 0
    prefix_cache_host_hits: int = 0
    prefix_cache_offload_bytes: int = 0  # evicted device blocks copied to host

    def record_prefix_lookup(self, queried: int, device_hits: int, host_hits: int) -> None:
        self.prefix_cache_queries += queried
        self.prefix_cache_device_hits += device_hits
        self.prefix_cache_host_hits += host_hits

    def record_offload(self, nbytes: int) -> None:
        """Evicted cached blocks copied to host: traffic of no request, so not in swap_out_bytes."""
        self.prefix_cache_offload_bytes += nbytes

    def record_preemption(self, m: RequestMetrics, started: bool = False) -> None:
        m.preemptions += 1
        self.preemptions += 1
        if started:
            m.started_preemptions += 1
            self.started_preemptions += 1

    def record_recompute(self, m: RequestMetrics, tokens: int) -> None:
        m.recomputed_tokens += tokens
        self.recomputed_tokens += tokens

    def record_swap(self, m: RequestMetrics, direction: Direction, nbytes: int, ops: int) -> None:
        m.swaps += 1
        m.swap_ops += ops
        self.swap_ops += ops
        if direction == "out":
            m.swap_out_bytes += nbytes
            self.swap_out_bytes += nbytes
        else:
            m.swap_in_bytes += nbytes
            self.swap_in_bytes += nbytes
