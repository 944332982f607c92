"""Data parallelism (`serve --data-parallel-size N`): N whole engines, each an engine core in a
process of its own (engine/core_client.py), behind one API server. This client is the
EngineClient the server drives: a request goes to the replica the router picks (engine/router.py)
and stays there; an abort or a priority change goes to the replica holding the request.

A replica that dies is removed: the router sends nothing more there, its started streams end with
the engine's error, and the server keeps serving on the others; it is dead only when none is left.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenslice.config import EngineConfig
from tokenslice.engine.core_client import EngineCoreClient
from tokenslice.engine.cpus import CpuPlan
from tokenslice.engine.protocol import (EngineDeadError, EngineInfo, EngineStats, OutputObserver, RequestStream,
                                        tokenize_prompt)
from tokenslice.engine.router import Router
from tokenslice.request import EngineRequest, RequestOutput
from tokenslice.sched.stats import SchedulerStats

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 5.0  # a replica's snapshot taking longer is left out of /v1/state


class DataParallelClient:
    def __init__(self, config: EngineConfig, *, max_waiting: int = 1024, log_level: int = logging.INFO,
                 cpus: list[CpuPlan] | None = None) -> None:
        """Start `config.parallel.data_parallel_size` engine cores at once (each loads the model in
        its own process) with `cpus[i]` for replica i; raises what EngineCoreClient raises."""
        n = config.parallel.data_parallel_size
        one = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))
        self.observer: OutputObserver | None = None
        self.on_dead: Callable[[], None] | None = None
        self.router = Router(config.parallel.router, n, slots=config.scheduler.max_batch_size)
        with ThreadPoolExecutor(n, thread_name_prefix="tokenslice-dp-start") as pool:
            starts = [pool.submit(EngineCoreClient, one, max_waiting=max_waiting, log_level=log_level,
                                  cpus=cpus[i] if cpus else None) for i in range(n)]
        failed = [f.exception() for f in starts if f.exception() is not None]
        if failed:
            for f in starts:
                if f.exception() is None:
                    f.result()._close()
            raise failed[0]
        self.replicas: list[EngineCoreClient] = [f.result() for f in starts]
        for i, core in enumerate(self.replicas):
            core.observer = self._observe
            core.on_dead = lambda i=i: self._replica_died(i)
            core.rescue = lambda rid, stream, i=i: self._rescue(i, rid, stream)
            core.name = f"data-parallel replica {i}'s engine core"
            log.info("data-parallel replica %d of %d: engine core process %d", i, n, core.pid)
        first = self.replicas[0]
        self.info: EngineInfo = first.info
        self.tokenizer: Any = first.tokenizer
        # prefix-aware: each live request's prompt and answer so far (the next turn's prefix)
        self._tokens: dict[str, list[int]] = {}
        self._unstarted: dict[str, EngineRequest] = {}  # placed, no output yet: re-routed if their replica dies
        self._dead: set[int] = set()
        self.rerouted = 0

    # ---- EngineClient ------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The replicas' snapshots summed (the scheduler counters too)."""
        live = [c.stats for i, c in enumerate(self.replicas) if self.router.alive[i]] or [self.replicas[0].stats]
        total = {f.name: sum(getattr(s, f.name) for s in live) for f in dataclasses.fields(EngineStats)
                 if f.name != "scheduler"}
        sched = {f.name: sum(getattr(s.scheduler, f.name) for s in live) for f in dataclasses.fields(SchedulerStats)
                 if isinstance(getattr(live[0].scheduler, f.name), (int, float))}
        return EngineStats(**total, scheduler=dataclasses.replace(live[0].scheduler, **sched))

    @property
    def is_alive(self) -> bool:
        return any(c.is_alive for c in self.replicas)

    @property
    def num_queued(self) -> int:
        return sum(c.num_queued for c in self.replicas)

    def start(self) -> None:
        for core in self.replicas:
            core.start()

    async def stop(self) -> None:
        await asyncio.gather(*(core.stop() for core in self.replicas))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    async def add_request(self, request: EngineRequest) -> RequestStream:
        try:
            i = self.router.choose(request)
        except RuntimeError:
            raise EngineDeadError("no engine replica is running") from None
        self.router.place(request, i)  # the router knows each request's replica from here on
        self._unstarted[request.request_id] = request
        if self.router.policy == "prefix-aware":
            self._tokens[request.request_id] = list(request.prompt_token_ids)
        try:
            return await self.replicas[i].add_request(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    def abort(self, stream: RequestStream) -> None:
        i = self.router.replica_of(stream.request_id)
        if i is not None:
            self.replicas[i].abort(stream)
            self._forget(stream.request_id)

    async def set_priority(self, request_id: str, priority: int) -> bool:
        i = self.router.replica_of(request_id)
        if i is None:  # finished, or never here: as one engine answers for a request it does not hold
            return await self.replicas[self.router.live_replicas[0] if self.router.live_replicas else 0
                                       ].set_priority(request_id, priority)
        return await self.replicas[i].set_priority(request_id, priority)

    async def state(self) -> dict[str, Any]:
        """The first live replica's snapshot, with every replica's under `replicas` (and the
        router's view: outstanding tokens and requests placed)."""
        states: list[dict[str, Any]] = []
        for i, core in enumerate(self.replicas):
            entry: dict[str, Any] = {"replica": i, "alive": self.router.alive[i] and core.is_alive,
                                     "pid": core.pid, "outstanding_tokens": self.router.work[i],
                                     "routed": self.router.routed[i]}
            if entry["alive"]:
                try:  # a replica that hangs must not hang the others' view
                    entry["state"] = await asyncio.wait_for(core.state(), STATE_TIMEOUT_S)
                except EngineDeadError:
                    entry["alive"] = False
                except TimeoutError:
                    entry["responding"] = False
            states.append(entry)
        first = next((s["state"] for s in states if "state" in s), None)
        if first is None:
            raise EngineDeadError("no engine replica is running")
        return first | {"data_parallel": {"size": len(self.replicas), "router": self.router.policy,
                                          "rerouted": self.rerouted, "replicas": states}}

    def replica_stats(self) -> list[tuple[bool, int, EngineStats]]:
        """Per replica: alive, outstanding tokens (the router's count) and its latest snapshot."""
        return [(self.router.alive[i] and core.is_alive, self.router.work[i], core.stats)
                for i, core in enumerate(self.replicas)]

    # ---- replicas ------------------------------------------------------------------------------
    def _observe(self, out: RequestOutput) -> None:
        self.router.produced(out.request_id, len(out.new_token_ids))
        self._unstarted.pop(out.request_id, None)
        seq = self._tokens.get(out.request_id)
        if seq is not None:
            seq.extend(out.new_token_ids)
        if out.finished:
            self._forget(out.request_id, complete=True)
        if self.observer is not None:
            self.observer(out)

    def _forget(self, request_id: str, complete: bool = False) -> None:
        self._unstarted.pop(request_id, None)
        seq = self._tokens.pop(request_id, None)
        self.router.finished(request_id, seq if complete else None)

    def _rescue(self, i: int, request_id: str, stream: RequestStream) -> bool:
        """Replica i died before `request_id` produced anything: run it on another live replica,
        on the same stream. False (the stream ends with the engine's error) if none can take it."""
        request = self._unstarted.get(request_id)
        if request is None:
            return False
        self.router.alive[i] = False  # choose elsewhere (the rest of the cleanup: _replica_died)
        try:
            j = self.router.choose(request)
        except RuntimeError:
            return False
        self.router.finished(request_id)
        self.router.place(request, j)
        try:
            self.replicas[j].adopt(request, stream)
        except EngineDeadError:
            self._forget(request_id)
            return False
        self.rerouted += 1
        log.warning("request %s: replica %d died before its first token; re-routed to replica %d", request_id, i, j)
        return True

    def _replica_died(self, i: int) -> None:
        if i in self._dead:
            return
        self._dead.add(i)
        gone = self.router.remove(i)
        for rid in gone:
            self._tokens.pop(rid, None)
            self._unstarted.pop(rid, None)
        left = len(self.router.live_replicas)
        log.error("data-parallel replica %d (engine core process %d) died with %d requests; %d replica(s) left",
                  i, self.replicas[i].pid, len(gone), left)
        if left == 0 and self.on_dead is not None:
            self.on_dead()
