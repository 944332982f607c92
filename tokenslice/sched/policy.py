"""The Policy base class (docs/DESIGN.md, Core types): every hook the scheduler may call, with
defaults, and what a policy may know about the system (PolicyContext)."""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenslice.config import SchedulerConfig
from tokenslice.predict.cost import CostModel
from tokenslice.request import Request

# Without a cost model, policies that need times assume this decode iteration (seconds).
DEFAULT_ITERATION_S = 0.02


@dataclass
class PolicyContext:
    """What a policy may know about the system: its config and the cost model."""

    config: SchedulerConfig
    cost: CostModel | None = None
    # decode_s is asked for every running job at every step; contexts repeat, so memoize.
    _decode_cache: dict[int, float] = field(default_factory=dict, repr=False)

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size

    def min_iteration_s(self) -> float:
        return self.cost.min_iteration_seconds() if self.cost else DEFAULT_ITERATION_S

    def first_iteration_s(self, prompt_len: int) -> float:
        if self.cost:
            return self.cost.first_iteration_seconds(prompt_len)
        return DEFAULT_ITERATION_S * max(1.0, prompt_len / 128)

    def decode_s(self, context: int) -> float:
        """One decode iteration of one request at this context (its share of a step)."""
        t = self._decode_cache.get(context)
        if t is None:
            t = self.cost.decode_seconds(1, context) if self.cost else DEFAULT_ITERATION_S
            self._decode_cache[context] = t
        return t

    def slo_normalized_latency(self) -> float:
        """The SLO the operator gave, or the paper protocol's 10x the decode iteration time."""
        return self.config.slo_normalized_latency or 10 * self.min_iteration_s()


class Policy:
    """Orders live requests; knows nothing about memory. Subclasses implement `ranked` and the
    hooks whose defaults do not fit; the scheduler calls nothing else."""

    name: str = ""
    # Whether the order reads Request.priority; the engine refuses non-zero priorities otherwise
    # (as vLLM does), so a client never believes a priority it sent was honoured.
    uses_priority: bool = False

    def on_arrival(self, req: Request, now: float) -> None:
        pass

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        """`ran` computed in a step of `step_seconds` that ended at `now`."""

    def on_finish(self, req: Request) -> None:
        pass

    def on_priority_change(self, req: Request, old_priority: int, now: float) -> None:
        """`req.priority` was just changed from `old_priority`; the next ranking must reflect it."""

    def ranked(self, now: float) -> Iterable[Request]:
        """Live requests, best first. May be lazy: the scheduler usually needs only the head, and
        does not change the policy's membership while it walks."""
        raise NotImplementedError

    def next_run_estimates(self, now: float) -> dict[str, float]:
        """Seconds until each live request is expected to run again (FastServe ENST, ALISE EWT);
        orders swaps and evictions. Default: the rank position (only the order matters)."""
        return {r.request_id: float(i) for i, r in enumerate(self.ranked(now))}

    def next_run_estimate(self, req: Request, now: float) -> float:
        return self.next_run_estimates(now).get(req.request_id, 0.0)

    # ---- simulator fast-forward: a decode batch repeated in bulk between events ---------------
    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        """How many of the upcoming steps (lasting `durations`, ending at `ends`) the batch `ran`
        may repeat before this policy's order could change; a change at the end of step j allows
        j + 1 steps. Default 1: the policy does not bound it, so nothing is repeated."""
        return 1

    def on_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> None:
        """Charge a run of steps at once, with the same effect as on_step once per step."""
        for d, t in zip(durations, ends, strict=True):
            self.on_step(ran, d, t)

    # ---- memory hints for proactive swapping --------------------------------------------------
    def top_queue_jobs(self, k: int) -> Iterable[Request]:
        """Jobs of the top k priority queues (FastServe §4.2 burst reserve); none by default."""
        return ()

    def device_job_limit(self, capacity_tokens: int, now: float) -> int | None:
        """ALISE Algorithm 2: how many top-ranked jobs a device with room for `capacity_tokens`
        KV tokens can keep until they finish; only those are uploaded. None: no limit."""
        return None

    # ---- live view ------------------------------------------------------------------------------
    def describe_queues(self) -> dict[str, Any]:
        """The policy's queues in its own terms as plain data (sched/snapshot.py): a "kind" and
        request ids with the numbers the order is made of, best first; never text or tokens.
        Reads only (`ranked` may change state, e.g. promote starving jobs, so it is not called).
        Default: nothing known beyond the kind."""
        return {"kind": "none"}


def queue_position_estimates(ranked: list[Request], remaining_s: dict[str, float], batch: int) -> dict[str, float]:
    """Seconds until each request runs, if jobs ahead of it run `remaining_s` each, `batch` at a
    time: the first `batch` run now; the rest wait for the work ahead to drain (FastServe §4.2,
    the execution term of ENST)."""
    out: dict[str, float] = {}
    ahead = 0.0
    for i, r in enumerate(ranked):
        out[r.request_id] = 0.0 if i < batch else ahead / batch
        ahead += remaining_s.get(r.request_id, 0.0)
    return out


class SortedKeys:
    """Each live request's sort key, kept in order (bisect): the ranking of policies whose keys
    change only at events (fixed-priority, priority, srpt-predicted). A key ends with its
    request id, so keys are unique."""

    def __init__(self) -> None:
        self._keys: list[tuple] = []
        self._key_of: dict[str, tuple] = {}

    def get(self, request_id: str) -> tuple | None:
        return self._key_of.get(request_id)

    def put(self, request_id: str, key: tuple) -> None:
        """Set (or replace) the request's key."""
        old = self._key_of.get(request_id)
        if key == old:
            return
        if old is not None:
            del self._keys[bisect.bisect_left(self._keys, old)]
        bisect.insort(self._keys, key)
        self._key_of[request_id] = key

    def pop(self, request_id: str) -> tuple | None:
        key = self._key_of.pop(request_id, None)
        if key is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]
        return key

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._keys)


class LiveSetPolicy(Policy):
    """Shared bookkeeping for policies that keep their live requests in arrival order and
    whose order changes only on arrivals and finishes (the scheduler sees those), so the
    simulator may repeat a batch until the next one."""

    def __init__(self) -> None:
        # Insertion order is arrival order; a dict keeps it and removes in O(1).
        self._live: dict[str, Request] = {}

    def on_arrival(self, req: Request, now: float) -> None:
        self._live[req.request_id] = req

    def on_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        self._live.pop(req.request_id, None)

    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        return len(ends)

    def describe_queues(self) -> dict[str, Any]:
        """One queue in arrival order: fcfs's ranking (subclasses that rank otherwise override)."""
        return {"kind": "fifo", "order": list(self._live)}
