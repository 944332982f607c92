"""Data parallelism on the simulator: N simulated engines (each its own scheduler, KV pool and
virtual clock) behind the same Router the API server uses (engine/router.py), so router policies
are compared at paper scale (16-64 replicas) without the hardware.

Discrete events: before a request is routed at its arrival time, every busy engine is advanced
to that time (its steps stop at the arrival, as a single engine's replay does), so the router
sees each replica's outstanding work as it is then; an idle engine's clock jumps to the arrival.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenslice.engine.router import Router
from tokenslice.request import EngineRequest, Request, SamplingParams
from tokenslice.sim.replay import TraceItem


class ReplicaSet:
    def __init__(self, engines: Sequence[Any], router: Router) -> None:
        self.engines = list(engines)
        self.router = router
        self._seen: list[dict[str, int]] = [{} for _ in self.engines]  # tokens the router was told of

    def _advance(self, i: int, until: float) -> None:
        """Run engine i until its clock reaches `until` or it has nothing left."""
        e = self.engines[i]
        while e.has_unfinished() and e.clock.now() < until:
            _, finished = e.advance(until)
            self._account(i, finished)

    def _account(self, i: int, finished: list[Request]) -> None:
        seen = self._seen[i]
        for rid, req in self.engines[i].scheduler.requests.items():
            n = req.num_output_tokens
            if n != seen.get(rid, 0):
                self.router.produced(rid, n - seen.get(rid, 0))
                seen[rid] = n
        for req in finished:
            seen.pop(req.request_id, None)
            self.router.finished(req.request_id, req.prompt_token_ids + req.output_token_ids)
            self.engines[i].forget_outputs(req.request_id)

    def replay(self, trace: Sequence[TraceItem]) -> tuple[list[Request], list[int]]:
        """Each request arrives at its time, goes to the replica the router picks and generates
        exactly its output length. Returns the requests (trace order) and each one's replica."""
        items = sorted(trace, key=lambda t: t.arrival_time)
        reqs: dict[str, tuple[Request, int]] = {}
        for item in items:
            t = item.arrival_time
            for i in range(len(self.engines)):
                self._advance(i, t)
            real = getattr(item, "prompt_token_ids", None)
            ids = real or [0] * max(1, item.prompt_len)
            new = EngineRequest(item.request_id, list(ids), SamplingParams(
                max_tokens=max(1, item.output_len), temperature=0.0, ignore_eos=True),
                arrival_time=t, user=getattr(item, "user", None), expected_output_tokens=item.output_len,
                predicted_output_tokens=getattr(item, "predicted_output_tokens", None),
                eos_after=max(1, item.output_len), cache_prefix=bool(real))
            i = self.router.choose(new)
            self.router.place(new, i)
            e = self.engines[i]
            if not e.has_unfinished() and e.clock.now() < t:
                e.clock.advance_to(t)
            reqs[item.request_id] = (e.add(new), i)
        for i in range(len(self.engines)):
            self._advance(i, float("inf"))
        return [reqs[t.request_id][0] for t in trace], [reqs[t.request_id][1] for t in trace]
