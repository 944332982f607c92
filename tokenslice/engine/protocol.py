"""What the API server drives, whichever engine client it has (docs/DESIGN.md, Data flow):
the `EngineClient` protocol, the per-request `RequestStream`, the admission bound both clients
share, the engine's stats and info snapshots, and the errors a request can end with.

AsyncEngine (the engine on a thread of this process) and EngineCoreClient (the engine in a
process of its own) both implement it; the engine core sends the snapshots over its socket.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokenslice.engine.output import OutputProcessor
from tokenslice.request import EngineRequest, InvalidRequestError, RequestOutput
from tokenslice.sched.stats import SchedulerStats

if TYPE_CHECKING:
    from tokenslice.engine.engine import Engine

# Consecutive failed steps after which the engine is declared dead (/health turns 503):
# one fault may be a bad batch; a run of them means the engine itself is broken.
MAX_CONSECUTIVE_FAULTS = 3


class EngineOverloadedError(RuntimeError):
    """More requests wait for their first token than the server admits; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


class EngineFaultError(RuntimeError):
    """The engine failed while this request was in flight (a server fault, not the client's)."""


class RequestFailedError(EngineFaultError):
    """The engine ended this request before it ran, for a reason the client should read (its
    grammar did not compile in time); the message says why."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the loop publishes after every iteration; read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    num_swapped: int = 0
    device_blocks_used: int = 0
    device_blocks_total: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)  # a copy, frozen with the rest
    num_steps: int = 0
    num_faults: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What the API server needs to know of the engine it fronts; fixed once the engine is built."""

    model_name: str
    max_model_len: int
    vocab_size: int
    uses_priority: bool  # the policy reads Request.priority (others refuse a non-zero one)


def engine_info(engine: Engine) -> EngineInfo:
    return EngineInfo(engine.model_name, engine.max_model_len, engine.vocab_size,
                      engine.scheduler.policy.uses_priority)


def read_stats(engine: Engine, num_faults: int = 0) -> EngineStats:
    """Snapshot of scheduler and KV state; call only from the thread that owns the engine."""
    sched = engine.scheduler
    kv = sched.kv
    return EngineStats(
        num_running=sched.num_running, num_waiting=sched.num_waiting, num_preempted=sched.num_preempted,
        num_swapped=sched.num_swapped, device_blocks_used=kv.device.num_used, device_blocks_total=kv.device.num_blocks,
        host_blocks_used=kv.host.num_used, host_blocks_total=kv.host.num_blocks,
        scheduler=dataclasses.replace(sched.stats), num_steps=engine.num_steps, num_faults=num_faults)


class RequestStream:
    """One request's outputs, in order; iterate with `async for`. Ends after the final output,
    or raises EngineFaultError / EngineDeadError if the engine failed the request."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self.queued = True  # counted against max_waiting until its first output
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


OutputObserver = Callable[[RequestOutput], None]


class EngineClient(Protocol):
    """What the API server drives: AsyncEngine (the engine on a thread of this process) or
    EngineCoreClient (engine/core_client.py: the engine in a process of its own)."""

    info: EngineInfo
    tokenizer: Any
    stats: EngineStats
    observer: OutputObserver | None  # sees every output the engine produces (metrics)
    on_dead: Callable[[], None] | None  # called once, in the event loop, if the engine dies

    @property
    def is_alive(self) -> bool: ...

    @property
    def num_queued(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def add_request(self, request: EngineRequest) -> RequestStream: ...

    def abort(self, stream: RequestStream) -> None: ...

    async def set_priority(self, request_id: str, priority: int) -> bool: ...

    async def state(self) -> dict[str, Any]: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...


class StreamAdmission:
    """The event-loop side both engine clients share: the bound on admitted requests still
    waiting for their first output (max_waiting; more are refused for a 429), and handing
    results to streams."""

    _outputs: OutputProcessor  # each client's: its streams' text, stop strings and metrics

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_queued = 0  # admitted requests without a first output yet

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def abort(self, stream: RequestStream) -> None:
        raise NotImplementedError

    def _new_stream(self, request_id: str) -> RequestStream:
        """A stream for a request about to be handed to the engine; raises EngineOverloadedError."""
        if self._loop is None:
            raise EngineDeadError("the engine client was never started")
        if self._num_queued >= self.max_waiting:
            raise EngineOverloadedError(f"{self._num_queued} requests are already waiting")
        return RequestStream(request_id, self._loop)

    async def _accepted(self, stream: RequestStream) -> RequestStream:
        """Count a handed-over request as waiting and return its stream once the engine accepted it."""
        self._num_queued += 1
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(stream)  # the client went away while the request was being queued
            raise
        return stream

    def _unqueue(self, stream: RequestStream) -> None:
        if stream.queued:
            stream.queued = False
            self._num_queued -= 1

    def _settle(self, stream: RequestStream, error: BaseException | None) -> None:
        """The engine's answer to an add: accepted, or refused with `error` (no output will come)."""
        if error is not None:
            self._unqueue(stream)
            self._outputs.forget(stream.request_id)
        if not stream.accepted.done():  # done already if the handler was cancelled
            if error is None:
                stream.accepted.set_result(None)
            else:
                stream.accepted.set_exception(error)
        elif error is not None and not stream.finished:  # an adopted request (EngineCoreClient.adopt)
            stream._queue.put_nowait(error)

    def _put(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        self._unqueue(stream)
        if not stream.accepted.done():  # failed before the handler heard it was accepted
            if isinstance(item, BaseException):
                stream.accepted.set_exception(item)
                return
            stream.accepted.set_result(None)
        stream._queue.put_nowait(item)


def tokenize_prompt(tokenizer: Any | None, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids, as the engine adds them (text gets the tokenizer's special tokens)."""
    if isinstance(prompt, str):
        if not prompt:  # checked before tokenizing: a BOS token would hide it
            raise InvalidRequestError("prompt is empty", "prompt")
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)
