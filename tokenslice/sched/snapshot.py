"""A scheduler's state as plain data, for a live view (`tokenslice simulate --record-state`).

`snapshot(scheduler, now)` reads, never changes: the policy's queues in its own terms
(`Policy.describe_queues`), every live request's state and counters, and the KV pools. It
carries request ids, users and counts only: never prompt or output text, never token ids.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tokenslice.request import Request, RequestState
from tokenslice.sched.scheduler import Scheduler

# Where a live request stands, as a live view shows it.
REQUEST_STATES = ("waiting", "running", "preempted", "swapping", "on host", "to recompute")


@dataclass(frozen=True)
class RequestView:
    id: str
    user: str | None
    tenant: str | None  # the API key's tenant (serve --api-keys)
    state: str  # one of REQUEST_STATES
    exec_s: float  # attained service: seconds of the steps it ran in (MLFQ's)
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # tokens whose KV is computed (0 after a drop)
    predicted_output_tokens: int | None
    priority: int
    preemptions: int
    swaps: int
    # Stall guard: seconds until the stream's next token is due (None: not started or no guard),
    # whether it runs next step for that, and how long its reader has waited so far.
    slack_s: float | None = None
    protected: bool = False
    stall_s: float = 0.0


@dataclass(frozen=True)
class PoolView:
    blocks: int
    used: int
    free: int


def request_state(scheduler: Scheduler, req: Request) -> str:
    """Where `req` stands: its KV in flight between tiers, running, on host, dropped after it
    ran (to recompute), never run (waiting), or paused with its KV on device (preempted)."""
    kv, rid = scheduler.kv, req.request_id
    if kv.in_flight(rid):
        return "swapping"
    if req.state is RequestState.RUNNING:
        return "running"
    residency = kv.residency(rid)
    if residency == "host":
        return "on host"
    if residency == "none" and (req.output_token_ids or req.metrics.preemptions):
        return "to recompute"
    return "waiting" if req.state is RequestState.WAITING else "preempted"


def request_view(scheduler: Scheduler, req: Request, now: float) -> RequestView:
    m = req.metrics
    guard = scheduler.stall_guard
    return RequestView(id=req.request_id, user=req.user, tenant=req.tenant,
                       state=request_state(scheduler, req), exec_s=m.exec_s,
                       prompt_tokens=req.num_prompt_tokens, output_tokens=req.num_output_tokens,
                       computed_tokens=req.num_computed_tokens, predicted_output_tokens=req.predicted_output_tokens,
                       priority=req.priority, preemptions=m.preemptions, swaps=m.swaps,
                       slack_s=guard.slack(req, now), protected=guard.is_protected(req.request_id), stall_s=m.stall_s)


def snapshot(scheduler: Scheduler, now: float) -> dict[str, Any]:
    """The scheduler at `now` as JSON-ready data (see the module doc)."""
    kv = scheduler.kv
    device, host = kv.device, kv.host
    return {
        "t": now,
        "policy": scheduler.policy.name,
        "preemption": scheduler.preemption.mode,
        "stall_guard": {"mode": "on" if scheduler.stall_guard.timeline else "off",
                        "max_stall_ms": None if scheduler.stall_guard.max_stall_s is None
                        else scheduler.stall_guard.max_stall_s * 1000.0},
        "queues": scheduler.policy.describe_queues(),
        # vars(), not asdict(): the fields are scalars, and asdict's deep copy was most of a
        # 1,000-request snapshot's time (a live server takes one every 250 ms).
        "requests": [vars(request_view(scheduler, r, now)) for r in scheduler.requests.values()],
        "kv": {"block_size": kv.block_size,
               "device": asdict(PoolView(device.num_blocks, device.num_blocks - device.num_free, device.num_free)),
               "host": asdict(PoolView(host.num_blocks, host.num_blocks - host.num_free, host.num_free)),
               # FastServe §4.2: free device blocks kept for a burst of new jobs.
               "reserved_blocks": scheduler.preemption.reserved_blocks(),
               "transfers_in_flight": kv.num_in_flight,
               "device_blocks_releasing": kv.device_blocks_releasing(),
               # Block groups by owner: each live request's blocks on device and on host.
               "owners": {rid: {"device": kv.num_device_blocks(rid), "host": len(kv.host_blocks(rid))}
                          for rid in scheduler.requests}},
    }


__all__ = ["REQUEST_STATES", "RequestView", "PoolView", "request_state", "request_view", "snapshot"]
