"""EngineCoreClient: the API server's side of the engine-core process (docs/DESIGN.md, Data flow).

It starts the core (engine/core.py) in a spawned, non-daemonic child (a core with tensor
parallelism starts worker processes of its own) and offers the server what AsyncEngine offers:
add_request -> RequestStream, abort, set_priority, state, is_alive, num_queued, stats. Here, in the
API-server process, it detokenizes and applies stop strings: on a stop string it ends the
stream itself and sends the core an abort, which frees the KV before the next step.

The event loop reads the core's messages from a zmq.asyncio socket; each step arrives as one
message and is delivered to every stream in one pass. The core's death (killed, or a fatal
fault) is seen at once through its process sentinel: every live request fails with
EngineDeadError, `is_alive` turns false and `on_dead` is called. Nothing here waits on the core
without a bound: sends never block (a core that is gone cannot take a message: EngineDeadError),
and `stop` waits for the core's exit a bounded time, then kills it. The core exits by itself
when this process dies (exec/parent_watch.py).
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenslice.config import CpuConfig, EngineConfig
from tokenslice.engine.protocol import (EngineDeadError, EngineFaultError, OutputObserver, RequestFailedError,
                                        RequestStream, StreamAdmission)
from tokenslice.engine.core import run_engine_core
from tokenslice.engine.cpus import CpuPlan, plan_cpus
from tokenslice.engine.core_messages import (Abort, AddRequest, CoreMessage, CoreOutput, Fatal, Ready, Refusal,
                                             SetPriority, Shutdown, StartupFailed, StateQuery)
from tokenslice.engine.output import OutputProcessor
from tokenslice.engine.protocol import tokenize_prompt
from tokenslice.engine.socket_dir import make_socket_dir, remove_stale_socket_dirs
from tokenslice.exec.parent_watch import kill_process_tree
from tokenslice.request import EngineRequest, InvalidRequestError, RequestOutput

log = logging.getLogger(__name__)

STARTUP_POLL_MS = 200  # while the core loads its model, check this often that it is still alive
STOP_TIMEOUT_S = 10.0  # a core that does not exit after Shutdown within this is killed
# A core that failed (or lost a rank) is already on its way out: killed if not gone within this,
# so that `serve` exits well within 5 s of any process's death.
DEAD_CORE_WAIT_S = 2.0


class EngineStartupError(RuntimeError):
    """The engine core could not start (bad model path, out of memory, ...)."""


def _answer(future: asyncio.Future[Any] | None, result: Any, error: Exception | None) -> None:
    """The core's reply to a call (a priority update, a state query), unless its caller left."""
    if future is None or future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _stop_core(process: Any) -> None:
    """Last resort (interpreter exit, or a core that ignores Shutdown): end it by its PID, with
    whatever it started (rank workers, Ray's processes), which would otherwise outlive it a while.
    The core ignores SIGTERM (see engine/core.py), so SIGKILL."""
    if process.is_alive():
        kill_process_tree(process.pid)
        process.join()


class EngineCoreClient(StreamAdmission):
    def __init__(self, config: EngineConfig, *, max_waiting: int = 1024, observer: OutputObserver | None = None,
                 log_level: int = logging.INFO, cpus: CpuPlan | None = None) -> None:
        """Start the core and wait until its engine is built; raises EngineStartupError if it cannot.
        `cpus`: the engine's CPUs and threads (default: CpuConfig's split of this process's CPUs)."""
        super().__init__(max_waiting)
        config.validate()
        self.observer = observer  # called in the event loop for every output of the core (metrics)
        self.on_dead: Callable[[], None] | None = None
        # Data parallelism: offered each request this core had not started when it died; True
        # if another core took it over (its stream then gets no error from here).
        self.rescue: Callable[[str, RequestStream], bool] | None = None
        self.name = "the engine core"  # in errors ("data-parallel replica 1's engine core")
        remove_stale_socket_dirs()  # those of servers killed with their cores
        self._dir = make_socket_dir()  # private: the ipc sockets live here
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # an abort must never wait
        self._from_core = self._ctx.socket(zmq.PULL)
        addresses = [f"ipc://{Path(self._dir) / name}" for name in ("input", "output")]
        self._to_core.bind(addresses[0])
        self._from_core.bind(addresses[1])
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_engine_core, name="tokenslice-engine-core", daemon=False,
                                     args=(msgspec.msgpack.encode(config), *addresses, log_level,
                                           cpus or plan_cpus(CpuConfig())))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.process.start()
        self.pid: int = self.process.pid  # type: ignore[assignment]
        self._finalizer = weakref.finalize(self, _stop_core, self.process)
        try:
            ready = self._wait_ready()
            from tokenslice.model.loader import load_tokenizer

            self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        except BaseException:
            self._close()
            raise
        self.info = ready.info
        self.stats = ready.stats
        log.info("engine core running in process %d", self.pid)
        self._live: dict[str, RequestStream] = {}  # requests the core runs for streams of this process
        # A stop string ends the stream here and tells the core to free the request's KV.
        self._outputs = OutputProcessor(self.tokenizer, lambda rid: self._send_quietly(Abort([rid])),
                                        merge_metrics=True)
        self._priority_calls: dict[int, asyncio.Future[bool]] = {}
        self._state_calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._dead = False
        self._stopping = False

    def _wait_ready(self) -> Ready:
        while not self._from_core.poll(STARTUP_POLL_MS):
            if not self.process.is_alive():
                raise EngineStartupError(f"the engine core exited with code {self.process.exitcode} before it was ready")
        msg = self._decoder.decode(self._from_core.recv())
        if isinstance(msg, StartupFailed):
            raise EngineStartupError(f"the engine could not start: {msg.message}")
        if not isinstance(msg, Ready):
            raise EngineStartupError(f"the engine core sent {type(msg).__name__} before it was ready")
        return msg

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    # ---- lifecycle (event-loop side) ------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's outputs; call from the event loop that will consume the streams."""
        if self._loop is not None:
            raise RuntimeError("EngineCoreClient already started")
        self._loop = asyncio.get_running_loop()
        gc.freeze()  # startup's objects live as long as the server: no full collection rescans them
        sock = zmq.asyncio.Socket.from_socket(self._from_core)
        self._reader = self._loop.create_task(self._read(sock), name="tokenslice-core-reader")
        self._loop.add_reader(self.process.sentinel, self._on_exit)
        if not self.process.is_alive():  # died before the watch began
            self._on_exit()

    async def stop(self) -> None:
        """Stop the core (Shutdown, then by its PID if it does not exit) and release the sockets."""
        self._stopping = True
        if self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
        if self.process.is_alive():
            try:
                self._send(Shutdown())
                wait_s = DEAD_CORE_WAIT_S if self._dead else STOP_TIMEOUT_S
            except EngineDeadError:  # it closed its input: failing, on its way out
                wait_s = DEAD_CORE_WAIT_S
            await asyncio.to_thread(self.process.join, wait_s)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_all(EngineDeadError("the engine was stopped"))
        self._close()

    def _close(self) -> None:
        self._finalizer()
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._stopping and self.process.is_alive()

    # ---- requests (event-loop side) --------------------------------------------------------------
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Send a request to the core; returns once the engine accepted it. Raises what
        AsyncEngine.add_request raises (InvalidRequestError, EngineOverloadedError, EngineDeadError)."""
        stream = self._new_stream(request.request_id)
        self._hand_over(request, stream)
        return await self._accepted(stream)

    def adopt(self, request: EngineRequest, stream: RequestStream) -> None:
        """Run a request that another core accepted and lost before its first output, on the
        stream its client already reads (data parallelism). Raises EngineDeadError."""
        self._hand_over(request, stream)
        self._num_queued += 1  # waiting for its first output here now

    def _hand_over(self, request: EngineRequest, stream: RequestStream) -> None:
        """Send the request to the core, its outputs to go to `stream`; EngineDeadError if it cannot."""
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        frame = self._encode(AddRequest(request))
        self._outputs.add(request.request_id, request.prompt_token_ids, request.params)
        self._live[request.request_id] = stream
        try:
            self._send_frame(frame)
        except EngineDeadError:
            self._live.pop(request.request_id, None)
            self._outputs.forget(request.request_id)
            raise

    def abort(self, stream: RequestStream) -> None:
        """Stop a request (its client left); the core frees its KV blocks before its next step."""
        self._unqueue(stream)
        if not stream.finished:
            stream.finished = True
            self._live.pop(stream.request_id, None)
            self._outputs.forget(stream.request_id)
            if self.is_alive:
                self._send_quietly(Abort([stream.request_id]))

    async def set_priority(self, request_id: str, priority: int) -> bool:
        """Change a live request's priority before the next step; as AsyncEngine.set_priority."""
        if self._loop is None or not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        call_id = next(self._call_ids)
        result: asyncio.Future[bool] = self._loop.create_future()
        self._priority_calls[call_id] = result
        try:
            self._send(SetPriority(call_id, request_id, priority))
            return await result
        finally:
            self._priority_calls.pop(call_id, None)

    async def state(self) -> dict[str, Any]:
        """The scheduler's snapshot (sched/snapshot.py), taken by the core between two steps."""
        if self._loop is None or not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        call_id = next(self._call_ids)
        result: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._state_calls[call_id] = result
        try:
            self._send(StateQuery(call_id))
            return await result
        finally:
            self._state_calls.pop(call_id, None)

    def _encode(self, msg: Any) -> bytes:
        """The message's frame; InvalidRequestError for what the wire cannot carry (a lone surrogate,
        an integer beyond 64 bits: server/protocol.py refuses those first, naming the field)."""
        try:
            return self._encoder.encode(msg)
        except (UnicodeEncodeError, OverflowError) as e:
            raise InvalidRequestError(f"the request cannot be sent to the engine: {e}") from None

    def _send(self, msg: Any) -> None:
        self._send_frame(self._encode(msg))

    def _send_frame(self, frame: bytes) -> None:
        """Never blocks: SNDHWM 0 queues without limit while the core is connected, and with no core
        connected (it exited, or closed its input on the way out) the message could never go."""
        try:
            self._to_core.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("the engine core is not taking messages") from None

    def _send_quietly(self, msg: Any) -> None:
        """A message that can be lost with the core (an abort): its death is handled where it is seen."""
        try:
            self._send(msg)
        except EngineDeadError:
            log.debug("dropped %s: the engine core is not taking messages", type(msg).__name__)

    # ---- core -> streams (event loop) ---------------------------------------------------------------
    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                msg = self._decoder.decode(await sock.recv())
                if isinstance(msg, CoreOutput):
                    self._on_output(msg)
                elif isinstance(msg, Fatal):
                    self._die(f"the engine core failed: {msg.message}")
        except Exception as e:  # without its reader the server can only hang: fail loudly instead
            log.exception("reading the engine core's outputs failed")
            self._die(f"reading the engine core's outputs failed: {type(e).__name__}: {e}")

    def _on_output(self, msg: CoreOutput) -> None:
        for reply in msg.added:
            stream = self._live.get(reply.request_id)
            if stream is not None:
                if reply.error is not None:
                    del self._live[reply.request_id]
                self._settle(stream, None if reply.error is None else self._error(reply.error))
        for p in msg.priorities:
            _answer(self._priority_calls.get(p.call_id), p.live, None if p.error is None else self._error(p.error))
        for st in msg.states:
            error = None if st.error is None else EngineFaultError(f"engine failed to describe its state: {st.error}")
            _answer(self._state_calls.get(st.call_id), st.state, error)
        for out in msg.outputs:
            self._deliver(out)
        if msg.failed:
            fault = EngineFaultError("the engine failed while running this request")
            for rid in msg.failed:
                stream = self._live.pop(rid, None)
                self._outputs.forget(rid)
                if stream is not None:
                    self._put(stream, RequestFailedError(msg.reasons[rid]) if rid in msg.reasons else fault)
        if msg.stats is not None:
            self.stats = msg.stats

    @staticmethod
    def _error(refusal: Refusal) -> Exception:
        return InvalidRequestError(refusal.message, refusal.param) if refusal.invalid else EngineFaultError(refusal.message)

    def _deliver(self, out: RequestOutput) -> None:
        route = self._outputs.process(out)
        if route == "drop":
            return
        self._observe(out)
        stream = self._live.get(out.request_id) if route == "stream" else None
        if stream is None:
            return
        if out.finished:
            del self._live[out.request_id]
        self._put(stream, out)

    def _observe(self, out: RequestOutput) -> None:
        if self.observer is not None:
            try:
                self.observer(out)
            except Exception:  # metrics must never take the server down
                log.exception("output observer failed")

    # ---- death ---------------------------------------------------------------------------------------
    def _on_exit(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.process.sentinel)
        if not self._stopping:
            self.process.join(0)
            self._die(f"{self.name} process exited with code {self.process.exitcode}")

    def _die(self, reason: str) -> None:
        if self._dead or self._stopping:
            return
        self._dead = True
        log.error("%s; failing %d live requests", reason, len(self._live))
        self._fail_all(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead()

    def _fail_all(self, error: EngineDeadError) -> None:
        streams, self._live = self._live, {}
        for rid, stream in streams.items():
            self._outputs.forget(rid)
            if stream.finished:
                continue
            if stream.queued and self.rescue is not None and self.rescue(rid, stream):
                self._unqueue(stream)
                stream.queued = True  # counted again by the core that took it over
                continue
            self._put(stream, error)
        for future in [*self._priority_calls.values(), *self._state_calls.values()]:
            if not future.done():
                future.set_exception(error)
