"""Messages between the API server and the engine-core process (docs/DESIGN.md, Data flow).

Encoded with msgspec's MessagePack, never pickled. The request, output and stats dataclasses
travel field by field as they are declared, so a field added to EngineRequest, RequestOutput or
RequestMetrics crosses the boundary with no change here.

In (API server -> core, one PUSH socket): AddRequest, Abort, SetPriority, StateQuery, Shutdown.
Out (core -> API server, one PUSH socket): Ready or StartupFailed first, then CoreOutput (one
per engine step, carrying every request's new tokens; and the replies to adds and priority
updates and state queries, sent before the step that follows them), and Fatal before the core exits on a fault.
"""
from __future__ import annotations

from typing import Any

import msgspec

from tokenslice.engine.protocol import EngineInfo, EngineStats
from tokenslice.request import EngineRequest, RequestOutput


# ---- in ------------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class SetPriority(msgspec.Struct, tag=True):
    call_id: int  # echoed in the PriorityReply
    request_id: str
    priority: int


class StateQuery(msgspec.Struct, tag=True):
    """Asks for the scheduler's snapshot (sched/snapshot.py) for the live view."""

    call_id: int  # echoed in the StateReply


class Shutdown(msgspec.Struct, tag=True):
    pass


CoreInput = AddRequest | Abort | SetPriority | StateQuery | Shutdown


# ---- out -----------------------------------------------------------------------------------------
class Refusal(msgspec.Struct):
    """Why the engine refused an add or a priority update."""

    message: str
    param: str | None = None
    invalid: bool = True  # the request's fault (InvalidRequestError: HTTP 400), else the engine's (500)


class AddReply(msgspec.Struct):
    request_id: str
    error: Refusal | None = None


class PriorityReply(msgspec.Struct):
    call_id: int
    live: bool = False
    error: Refusal | None = None


class StateReply(msgspec.Struct):
    call_id: int
    state: dict[str, Any] = {}
    error: str | None = None  # the engine failed to describe itself (the core keeps running)


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo
    stats: EngineStats


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class CoreOutput(msgspec.Struct, tag=True):
    outputs: list[RequestOutput] = []
    added: list[AddReply] = []
    priorities: list[PriorityReply] = []
    states: list[StateReply] = []
    failed: list[str] = []  # live requests that a failed step took down (or that `reasons` ended)
    reasons: dict[str, str] = {}  # of `failed`, those the engine ended for a reason the client reads
    stats: EngineStats | None = None  # at most every STATS_INTERVAL_S, and whenever the engine goes idle


class Fatal(msgspec.Struct, tag=True):
    message: str


CoreMessage = Ready | StartupFailed | CoreOutput | Fatal
