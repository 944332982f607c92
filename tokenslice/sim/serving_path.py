"""The serving path outside the engine loop, as the simulator models it for HTTP clients.

A client of `tokenslice serve` sees more than the engine's steps: its request crosses HTTP
parsing, tokenization and the ZMQ hop to the engine core before the engine can schedule it
(ingress), and every token crosses the hop back, detokenization and SSE framing before the
client reads it (egress). Measured from step traces by `sim/trace_compare.py`; zero (the
defaults) leaves a simulation exactly as it was, so simulated sweeps keep their results.

The engine sees a request `ingress_s` after the client sent it, and the client sees each token
`egress_s` after the engine produced it; latencies stay measured from the client's send time.
The API server takes requests in one at a time (one event loop parses, tokenizes and forwards
each), so a burst reaches the engine spread out: with `ingress_gap_s`, two requests reach it at
least that far apart, a single-server queue in front of the engine. Egress grows with the
tokens the API server streams: one event loop takes each step's outputs and detokenizes and
frames every stream's token in one pass, so with `egress_per_token_s` a token reaches its client
that much later for every token its step emitted (the simulator's tokens of one step share a time).
No torch here.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenslice.bench.metrics import RequestRecord
from tokenslice.bench.workloads import WorkloadRequest


@dataclass(frozen=True)
class ServingPath:
    ingress_s: float = 0.0  # client send -> the engine can schedule the request
    egress_s: float = 0.0  # token produced -> the client has read it
    ingress_gap_s: float = 0.0  # the API server's own time per request: arrivals queue behind it
    egress_per_token_s: float = 0.0  # egress grows by this per token its step emitted (streams served)

    def validate(self) -> None:
        for name in ("ingress_s", "egress_s", "ingress_gap_s", "egress_per_token_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {v}")

    @property
    def is_zero(self) -> bool:
        return (self.ingress_s == 0.0 and self.egress_s == 0.0 and self.ingress_gap_s == 0.0
                and self.egress_per_token_s == 0.0)

    def egress_delays(self, records: Sequence[RequestRecord]) -> dict[float, float]:
        """Per engine-side token time, its egress: `egress_s`, plus `egress_per_token_s` for every
        token emitted at that time (by one step) across all the records."""
        emitted = Counter(t for r in records for t in r.token_times)
        return {t: self.egress_s + self.egress_per_token_s * n for t, n in emitted.items()}

    def ingress_delays(self, requests: Sequence[WorkloadRequest]) -> dict[str, float]:
        """Per request id, from the client's send to the engine having it: `ingress_s`, plus the
        wait behind earlier requests still being taken in (`ingress_gap_s` each), in send order."""
        delays, free = {}, -math.inf
        for r in sorted(requests, key=lambda r: r.arrival_time):
            free = max(r.arrival_time + self.ingress_s, free + self.ingress_gap_s)
            delays[r.request_id] = free - r.arrival_time
        return delays

    def to_engine(self, requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
        """The requests as the engine receives them: each `ingress_delays` later."""
        if self.ingress_s == 0.0 and self.ingress_gap_s == 0.0:
            return list(requests)
        delays = self.ingress_delays(requests)
        return [dataclasses.replace(r, arrival_time=r.arrival_time + delays[r.request_id]) for r in requests]

    def to_client(self, records: Sequence[RequestRecord], delays: Mapping[str, float] | None = None
                  ) -> list[RequestRecord]:
        """Engine-side records as the client sees them: sent their ingress delay earlier (`delays`,
        from `ingress_delays`; default `ingress_s`), every token its egress later (`egress_delays`),
        the finish as late as the last token. Queueing time absorbs both (the request waited outside
        the engine); execution time is the engine's."""
        if self.is_zero:
            return list(records)
        egress = self.egress_delays(records)

        def egress_of(t: float | None) -> float:
            return self.egress_s if t is None else egress.get(t, self.egress_s)

        out = []
        for r in records:
            ingress = self.ingress_s if delays is None else delays.get(r.request_id, self.ingress_s)
            first, finish = egress_of(r.first_token_time), egress_of(r.finish_time)
            out.append(dataclasses.replace(
                r, arrival=r.arrival - ingress, token_times=[t + egress_of(t) for t in r.token_times],
                first_token_time=None if r.first_token_time is None else r.first_token_time + first,
                finish_time=None if r.finish_time is None else r.finish_time + finish,
                queue_s=r.queue_s + ingress + first))
        return out


__all__ = ["ServingPath"]
