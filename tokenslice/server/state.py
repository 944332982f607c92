"""The live view's data (`GET /v1/state`, `GET /v1/state/stream`): the scheduler's snapshot
(sched/snapshot.py, taken by the engine between two steps) with what only the API server
knows: the engine's counters as /metrics reports them, recent swap traffic, the last minute's
TTFT/TBT percentiles, and counts of requests by state.

One producer however many viewers: a snapshot is asked of the engine at most every
`min_interval_s`, only when someone asks, and every viewer shares it, so the engine's cost is
bounded by the rate, not by the number of viewers. Ids, users and counts only, never text.

A tenant that is not an admin (`serve --api-keys`, server/identity.py) sees only its own
requests: their ids, users and queue places; other tenants' ids and users are left out, while
the aggregate numbers (counts by state, KV pools, latency, swap traffic) stay whole.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenslice.engine.protocol import EngineClient, EngineDeadError, EngineFaultError
from tokenslice.sched.snapshot import REQUEST_STATES
from tokenslice.server.identity import Tenant
from tokenslice.server.latency_window import WINDOW_S
from tokenslice.server.metrics import ServerMetrics

MIN_INTERVAL_S = 0.25  # at most 4 snapshots a second from the engine
SSE_KEEPALIVE_S = 15.0  # a comment line so proxies keep an idle stream open


def encode(state: dict[str, Any]) -> bytes:
    """JSON a browser can parse: an infinite or NaN number (an MLFQ without a starvation limit,
    an unknown estimate) becomes null, where json.dumps would write `Infinity`."""
    return msgspec.json.encode(state)


class StateHub:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.engine = engine
        self.metrics = metrics
        self.min_interval_s = min_interval_s
        self.viewers = 0  # open /v1/state/stream connections
        self.seq = 0  # snapshots taken from the engine
        self._latest: dict[str, Any] | None = None
        self._taken_at = -math.inf
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        # Per view (None: the whole state; else a tenant's), (seq, SSE event): encoded once for
        # every viewer of that view.
        self._events: dict[str | None, tuple[int, str]] = {}
        # (monotonic time, swap out bytes, swap in bytes, swap ops): one sample per snapshot.
        self._swap: deque[tuple[float, int, int, int]] = deque()

    async def get(self) -> dict[str, Any]:
        """The latest state, fresh within `min_interval_s`; concurrent callers share one query."""
        if self._latest is not None and time.monotonic() - self._taken_at < self.min_interval_s:
            return self._latest
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._take())
        # shield: a viewer that leaves must not cancel the query the others wait on.
        return await asyncio.shield(self._pending)

    async def _take(self) -> dict[str, Any]:
        try:
            state = await self.engine.state()
        finally:
            self._pending = None
        now = time.monotonic()
        self.seq += 1
        stats = self.engine.stats
        counters = stats.scheduler
        self._swap.append((now, counters.swap_out_bytes, counters.swap_in_bytes, counters.swap_ops))
        while self._swap and self._swap[0][0] < now - WINDOW_S:
            self._swap.popleft()
        counts = Counter(r["state"] for r in state["requests"])
        state.update(
            seq=self.seq, time=time.time(), viewers=self.viewers,
            counts={s: counts.get(s, 0) for s in REQUEST_STATES},
            engine={"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                    "num_preempted": stats.num_preempted, "num_swapped": stats.num_swapped,
                    "num_steps": stats.num_steps, "admission_queue": self.engine.num_queued},
            counters=dataclasses.asdict(counters),
            swap=self._swap_traffic(),
            latency={"window_s": WINDOW_S, "ttft": self.metrics.recent_ttft.summary(),
                     "tbt": self.metrics.recent_tbt.summary()})
        self._latest, self._taken_at = state, now
        return state

    def _swap_traffic(self) -> dict[str, Any]:
        """Bytes and copy operations over the samples of the last minute, and the rate between
        each two samples (the page's sparkline): seconds before now, out and in bytes/s."""
        samples = list(self._swap)
        first, last = samples[0], samples[-1]
        series = [[round(b[0] - last[0], 3), (b[1] - a[1]) / (b[0] - a[0]), (b[2] - a[2]) / (b[0] - a[0])]
                  for a, b in zip(samples, samples[1:]) if b[0] > a[0]]
        return {"window_s": round(last[0] - first[0], 3), "out_bytes": last[1] - first[1],
                "in_bytes": last[2] - first[2], "ops": last[3] - first[3], "series": series}

    def _encoded(self, state: dict[str, Any], tenant: Tenant) -> str:
        view = None if tenant.admin else tenant.name
        seq, event = self._events.get(view, (-1, ""))
        if seq != state["seq"]:
            event = f"data: {encode(visible_state(state, tenant)).decode()}\n\n"
            self._events[view] = (state["seq"], event)
        return event

    async def stream(self, tenant: Tenant) -> AsyncIterator[str]:
        """Server-sent events: one `data:` line per new snapshot (as `tenant` may see it), every
        `min_interval_s` at most, until the client leaves (the response is cancelled)."""
        self.viewers += 1
        try:
            last_sent, last_beat = -1, time.monotonic()
            while True:
                try:
                    state = await self.get()
                except (EngineDeadError, EngineFaultError) as e:
                    yield f"event: error\ndata: {json.dumps({'message': str(e)})}\n\n"
                    return
                if state["seq"] != last_sent:
                    last_sent, last_beat = state["seq"], time.monotonic()
                    yield self._encoded(state, tenant)
                elif time.monotonic() - last_beat > SSE_KEEPALIVE_S:
                    last_beat = time.monotonic()
                    yield ": keepalive\n\n"
                await asyncio.sleep(max(0.0, self._taken_at + self.min_interval_s - time.monotonic()))
        finally:
            self.viewers -= 1


def visible_state(state: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    """The state as `tenant` may see it: all of it for an admin; else without other tenants'
    request ids and users (see the module doc)."""
    if tenant.admin:
        return state
    foreign = {r["id"] for r in state["requests"] if r.get("tenant") != tenant.name}
    return {**state, "requests": [r for r in state["requests"] if r["id"] not in foreign],
            "queues": _own(state["queues"], foreign, tenant.name),
            "kv": {**state["kv"], "owners": {rid: v for rid, v in state["kv"]["owners"].items() if rid not in foreign}}}


def _own(node: Any, foreign: set[str], name: str | None) -> Any:
    """A policy's queues (Policy.describe_queues) without the requests in `foreign`: ids, entries
    with such an `id`, entries of other tenants, and groups (a user's, a priority class) left
    empty by the filter; an MLFQ level stays, empty."""
    if isinstance(node, dict):
        return {k: _own(v, foreign, name) for k, v in node.items()}
    if not isinstance(node, list):
        return node
    out = []
    for item in node:
        if isinstance(item, str) and item in foreign:
            continue
        if isinstance(item, dict):
            if item.get("id") in foreign or ("tenant" in item and item["tenant"] != name):
                continue
            kept = _own(item, foreign, name)
            if item.get("requests") and not kept["requests"] and "level" not in item:
                continue
            item = kept
        out.append(item)
    return out


__all__ = ["StateHub", "MIN_INTERVAL_S", "encode", "visible_state"]
