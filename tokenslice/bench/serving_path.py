"""The serving path outside the engine loop, as the simulator models it for HTTP clients.

A client of `tokenslice serve` sees more than the engine's steps: its request crosses HTTP
parsing, tokenization and the ZMQ hop to the engine core before the engine can schedule it
(ingress), and every token crosses the hop back, detokenization and SSE framing before the
client reads it (egress). Measured from step traces by `bench/trace_compare.py`; zero (the
defaults) leaves a simulation exactly as it was, so simulated sweeps keep their results.

The engine sees a request `ingress_s` after the client sent it, and the client sees each token
`egress_s` after the engine produced it; latencies stay measured from the client's send time.
No torch here.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenslice.bench.metrics import RequestRecord
from tokenslice.bench.workloads import WorkloadRequest


@dataclass(frozen=True)
class ServingPath:
    ingress_s: float = 0.0  # client send -> the engine can schedule the request
    egress_s: float = 0.0  # token produced -> the client has read it

    def validate(self) -> None:
        for name in ("ingress_s", "egress_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {v}")

    @property
    def is_zero(self) -> bool:
        return self.ingress_s == 0.0 and self.egress_s == 0.0

    def to_engine(self, requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
        """The requests as the engine receives them: each `ingress_s` later."""
        if self.ingress_s == 0.0:
            return list(requests)
        return [dataclasses.replace(r, arrival_time=r.arrival_time + self.ingress_s) for r in requests]

    def to_client(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """Engine-side records as the client sees them: sent `ingress_s` earlier, every token and
        the finish `egress_s` later. Queueing time absorbs both (the request waited outside the
        engine); execution time is the engine's."""
        if self.is_zero:
            return list(records)
        shift = self.egress_s
        out = []
        for r in records:
            out.append(dataclasses.replace(
                r, arrival=r.arrival - self.ingress_s, token_times=[t + shift for t in r.token_times],
                first_token_time=None if r.first_token_time is None else r.first_token_time + shift,
                finish_time=None if r.finish_time is None else r.finish_time + shift,
                queue_s=r.queue_s + self.ingress_s + shift))
        return out


__all__ = ["ServingPath"]
