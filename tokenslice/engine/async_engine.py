"""AsyncEngine: runs Engine.step() in a background thread and streams each request's outputs
into its own asyncio queue (docs/DESIGN.md, Data flow).

Output processing overlaps the next step (vLLM v1's overlap, as the engine-core process does
it): the loop thread only steps the engine; detokenization, stop strings and metrics run in the
event loop while the loop computes the next step. A stop string ends the stream there and
queues an abort, so the token of the step already in flight is computed but never sent.

The Engine is not thread-safe, so only the loop thread touches it. The asyncio side sends
commands (add, abort, priority update, stop) through a thread-safe queue that the loop drains
between steps, and the loop hands results back with `call_soon_threadsafe`. An abort or a
priority update therefore takes effect before the next iteration. When no request is live the loop blocks on the command queue instead of
spinning.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenslice.engine.core_loop import CoreLoop, StepOutcome
from tokenslice.engine.engine import Engine
from tokenslice.engine.output import OutputProcessor
from tokenslice.engine.protocol import (EngineDeadError, EngineFaultError, OutputObserver, RequestFailedError,
                                        RequestStream, StreamAdmission, engine_info, read_stats)
from tokenslice.request import EngineRequest, InvalidRequestError, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Add:
    stream: RequestStream
    request: EngineRequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _SetPriority:
    request_id: str
    priority: int
    result: asyncio.Future[bool]  # whether the request was live; or the engine's refusal


@dataclass
class _State:
    result: asyncio.Future[dict[str, Any]]  # the scheduler's snapshot (sched/snapshot.py)


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _SetPriority | _State | _Stop


class AsyncEngine(StreamAdmission):
    def __init__(self, engine: Engine, *, max_waiting: int = 1024,
                 observer: OutputObserver | None = None) -> None:
        super().__init__(max_waiting)
        self.engine = engine
        self.info = engine_info(engine)
        self.tokenizer = engine.tokenizer
        self.observer = observer  # called in the event loop for every output (metrics)
        engine.detokenize = False  # done here, in the event loop, overlapping the next step
        # Event-loop side: a stop string ends the stream here and queues the engine's abort.
        self._outputs = OutputProcessor(engine.tokenizer, lambda rid: self._commands.put(_Abort(rid)))
        self.on_dead: Callable[[], None] | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # The loop thread's: the core loop (engine/core_loop.py) and the streams of its live requests.
        self._core = CoreLoop(engine)
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._alive = False
        self._lock = threading.Lock()  # orders "loop ended" against enqueuing an add
        self.stats = read_stats(engine)

    # ---- lifecycle (event-loop side) --------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="tokenslice-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine loop did not stop within %.0f s", timeout)
        else:
            self.engine.close()

    @property
    def is_alive(self) -> bool:
        return self._alive and self._thread is not None and self._thread.is_alive()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    # ---- requests (event-loop side) ---------------------------------------------------------
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError for a
        request the engine refuses, EngineOverloadedError when max_waiting requests already
        wait for their first token, EngineDeadError when the loop is not running."""
        stream = self._new_stream(request.request_id)
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine loop is not running")
            self._outputs.add(request.request_id, request.prompt_token_ids, request.params)
            self._commands.put(_Add(stream, request))
        return await self._accepted(stream)

    def abort(self, stream: RequestStream) -> None:
        """Stop a request (its client left); its KV blocks are freed before the next step."""
        self._unqueue(stream)
        if not stream.finished:
            stream.finished = True
            self._outputs.forget(stream.request_id)
            self._commands.put(_Abort(stream.request_id))

    async def set_priority(self, request_id: str, priority: int) -> bool:
        """Change a live request's priority before the next step (FastSwitch's priority updates).
        Returns whether the request was live; raises InvalidRequestError when the policy does not
        use priorities, EngineDeadError when the loop is not running."""
        if self._loop is None:
            raise EngineDeadError("the engine loop was never started")
        result: asyncio.Future[bool] = self._loop.create_future()
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(_SetPriority(request_id, priority, result))
        return await result

    async def state(self) -> dict[str, Any]:
        """The scheduler's snapshot (sched/snapshot.py), taken by the loop between two steps."""
        if self._loop is None:
            raise EngineDeadError("the engine loop was never started")
        result: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(_State(result))
        return await result

    # ---- loop thread -> event loop ----------------------------------------------------------
    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    @staticmethod
    def _resolve(future: asyncio.Future[Any], result: Any) -> None:
        if future.done():  # the caller was cancelled
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in items:
            self._outputs.forget(stream.request_id)
            self._put(stream, item)

    def _deliver_outputs(self, items: list[tuple[RequestStream | None, RequestOutput]]) -> None:
        """A step's outputs, in the event loop: text, stop strings, metrics, then the streams.
        `stream` is None for a request no longer streamed (aborted)."""
        for stream, out in items:
            route = self._outputs.process(out)
            if route == "drop":
                continue
            if self.observer is not None:
                try:
                    self.observer(out)
                except Exception:  # metrics must never take the server down
                    log.exception("output observer failed")
            if stream is not None and route == "stream":
                self._put(stream, out)

    # ---- the loop (its own thread; the only code that touches the engine) --------------------
    def _run(self) -> None:
        try:
            self._core.run(self._drain, self._deliver_step)
        except Exception:
            log.exception("engine loop crashed")
            if self.on_dead is not None:
                self._call_soon(self.on_dead)
        finally:
            with self._lock:
                self._alive = False
            dead = EngineDeadError("the engine loop stopped")
            streams, self._streams = self._streams, {}
            if streams:
                self._call_soon(self._deliver, [(s, dead) for s in streams.values()])
            self._fail_pending(dead)

    def _fail_pending(self, error: BaseException) -> None:
        """Refuse adds still in the command queue after the loop ended."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._call_soon(self._settle, cmd.stream, error)
            elif isinstance(cmd, (_SetPriority, _State)):
                self._call_soon(self._resolve, cmd.result, error)

    def _drain(self, block: bool) -> bool:
        """Publish the stats, then apply queued commands (waiting for one if `block`); False when
        told to stop."""
        self.stats = read_stats(self.engine, self._core.num_faults)
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _SetPriority):
                self._set_priority(cmd)
            elif isinstance(cmd, _State):
                self._call_soon(self._resolve, cmd.result, self._snapshot())
            else:
                self._abort(cmd.request_id)
        return True

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        try:
            self._core.add(cmd.request)
        except InvalidRequestError as e:
            self._call_soon(self._settle, cmd.stream, e)
            return
        except Exception as e:  # a fault in the engine, not in the request
            log.exception("request %s: engine failed to add it", rid)
            self._call_soon(self._settle, cmd.stream, EngineFaultError(f"engine failed to add request: {e}"))
            return
        self._streams[rid] = cmd.stream
        self._call_soon(self._settle, cmd.stream, None)

    def _set_priority(self, cmd: _SetPriority) -> None:
        result: bool | BaseException
        try:
            result = self._core.set_priority(cmd.request_id, cmd.priority)
        except InvalidRequestError as e:
            result = e
        except Exception as e:  # a fault in the engine, not in the request
            log.exception("request %s: engine failed to change its priority", cmd.request_id)
            result = EngineFaultError(f"engine failed to change the priority: {e}")
        self._call_soon(self._resolve, cmd.result, result)

    def _snapshot(self) -> dict[str, Any] | BaseException:
        try:
            return self._core.state()
        except Exception as e:  # a view must never take the engine down
            log.exception("engine failed to describe its state")
            return EngineFaultError(f"engine failed to describe its state: {e}")

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._core.abort([request_id])
            log.debug("request %s aborted", request_id)

    def _deliver_step(self, outcome: StepOutcome) -> None:
        """A step's outcome to the event loop, where outputs are processed while this thread runs
        the next step."""
        if outcome.fault:
            fault = EngineFaultError("the engine failed while running this request")
            failed = [self._streams.pop(rid) for rid in outcome.failed if rid in self._streams]
            self._call_soon(self._deliver, [(s, fault) for s in failed])
            return
        ended = [(self._streams.pop(rid), RequestFailedError(why)) for rid, why in outcome.reasons.items()
                 if rid in self._streams]
        if ended:
            self._call_soon(self._deliver, ended)
        items: list[tuple[RequestStream | None, RequestOutput]] = []
        for out in outcome.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        if items:
            self._call_soon(self._deliver_outputs, items)
