"""The engine-core process (docs/DESIGN.md, Data flow): Engine.step() in a loop of its own, fed and
drained over ZMQ by the API server (engine/core_client.py), so HTTP, tokenization and
detokenization never compete with the engine for one interpreter lock.

Between steps the loop applies every queued message (adds, aborts, priority updates), so an
abort frees its KV before the next step; the replies to adds and priority updates go out at
once, the step's outputs after the step, all requests in one message. With nothing live it
blocks on its input instead of spinning, checking its rank workers meanwhile (a dead one ends
the core at once, not at the next request), and exits when the API server that started it is
gone (exec/parent_watch.py).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from tokenslice.config import EngineConfig
from tokenslice.engine.cpus import CpuPlan, pin_process
from tokenslice.engine.protocol import EngineStats, engine_info, read_stats
from tokenslice.engine.core_messages import (Abort, AddReply, AddRequest, CoreInput, CoreOutput, Fatal,
                                             PriorityReply, Ready, Refusal, SetPriority, Shutdown, StartupFailed,
                                             StateQuery, StateReply)
from tokenslice.engine.core_loop import CoreLoop, StepOutcome
from tokenslice.engine.engine import Engine
from tokenslice.engine.socket_dir import remove_socket_dir_of
from tokenslice.exec.parent_watch import exit_with_parent
from tokenslice.request import InvalidRequestError, RequestOutput

log = logging.getLogger("tokenslice.engine.core")

# Stats for /metrics ride on step outputs at most this often (and whenever the engine goes idle):
# a scrape never needs them fresher, and copying them every step would be wasted work.
STATS_INTERVAL_S = 0.05
# How often an idle core checks that its rank workers still live (a death ends the server within this).
IDLE_CHECK_MS = 200
SEND_LINGER_MS = 2000  # a last message (Fatal, StartupFailed) gets this long to leave


def run_engine_core(config: bytes, input_address: str, output_address: str, log_level: int,
                    cpus: CpuPlan) -> None:
    """Process entry point (multiprocessing spawn): build the engine, say Ready, run the loop.
    `config` is a msgspec-encoded EngineConfig; `cpus` the engine's CPUs and threads (engine/cpus.py).
    Exits non-zero if the engine cannot start or fails."""
    # Ctrl-C, and SIGTERM from `timeout` or systemd, reach the whole process group: the API
    # server decides when the core stops (a core whose API server is gone exits by itself).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A core whose API server is gone has no one to serve; the sockets' folder goes with it.
    exit_with_parent("tokenslice engine core", cleanup=lambda: remove_socket_dir_of(input_address))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("engine core process %d starting", os.getpid())
    # Stay off the API server's CPUs: on CPU, compute threads that share cores with a busy
    # process stall at every parallel barrier. Workers started later (tensor parallel) inherit it.
    if cpus.pin:
        pin_process(cpus.engine_cpus)
    import torch

    from tokenslice.model.loader import load_arch  # torch: after the pinning above

    torch.set_num_threads(cpus.engine_threads)
    ctx = zmq.Context()
    if hasattr(os, "SCHED_BATCH"):  # Linux
        # ZMQ's I/O thread, woken by every step's send, then does not preempt the compute thread
        # on a busy CPU (measured: 3-7% more single-stream tok/s on 2 cores).
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        ctx.set(zmq.THREAD_PRIORITY, 0)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_address)
    out = ctx.socket(zmq.PUSH)
    # Never blocks, on a slow reader or on none: a connecting PUSH queues without a peer, here without limit.
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        try:
            engine_config = msgspec.msgpack.decode(config, type=EngineConfig)
            # Before the engine starts compiling its decode steps: torch guards a compiled step
            # on the thread count it was built with, and a step run with another count fails.
            matmul_params = load_arch(engine_config.model).matmul_params
            threads = cpus.threads_for(matmul_params)
            if threads != cpus.engine_threads:
                log.info("%d torch threads, one per CPU: a model of %.0f M weights per token pays for them",
                         threads, matmul_params / 1e6)
                torch.set_num_threads(threads)
            engine = Engine.from_config(engine_config)
        except Exception as e:
            log.debug("engine failed to start", exc_info=True)
            out.send(encoder.encode(StartupFailed(str(e) or type(e).__name__)))
            code = 1
            return
        engine.detokenize = False
        # What startup built (the model, torch's and transformers' objects) lives as long as the
        # process: keep it out of every later full collection, a pause between two steps.
        gc.freeze()
        try:
            out.send(encoder.encode(Ready(engine_info(engine), read_stats(engine))))
            EngineCore(engine, inp, out).run()
        except Exception as e:
            log.exception("engine core failed")
            out.send(encoder.encode(Fatal(f"{type(e).__name__}: {e}")))
            code = 1
        finally:
            engine.close()
    finally:
        inp.close(linger=0)
        out.close(linger=SEND_LINGER_MS)
        ctx.term()
        if code:
            sys.exit(code)


def _refusal(e: Exception, what: str, request_id: str) -> Refusal:
    if isinstance(e, InvalidRequestError):
        return Refusal(str(e), e.param)
    log.error("request %s: engine failed to %s", request_id, what, exc_info=e)
    return Refusal(f"engine failed to {what}: {e}", invalid=False)


def _compiled_decode(engine: Engine) -> dict[str, Any]:
    """The state's compiled_decode entry (model/inductor_decode.py CompileStatus) when the model
    runs in this process: pending while the steps are built in the background (they run eager)."""
    runner = getattr(engine, "runner", None)
    return {"compiled_decode": dataclasses.asdict(runner.compile_status())} if runner is not None else {}


def _wire_output(out: RequestOutput) -> RequestOutput:
    """The output as it is sent: its metrics carry only the new tokens' times (the API server
    keeps the rest), so a step's message does not grow with each request's length."""
    m = out.metrics
    if m is not None:
        out.metrics = copy.copy(m)  # the engine's record stays whole
        out.metrics.token_times = m.token_times[len(m.token_times) - len(out.new_token_ids):]
    return out


class EngineCore:
    """The core loop's (engine/core_loop.py) ZMQ shell in this process: commands in from the
    input socket between steps, replies and step outputs out."""

    def __init__(self, engine: Engine, inp: zmq.Socket, out: zmq.Socket) -> None:
        self.engine = engine
        self.loop = CoreLoop(engine)
        self.inp = inp
        self.out = out
        # Executors with rank workers (exec/multiproc.py, exec/ray_executor.py) raise WorkerError here
        # once one is gone; the in-process one has nothing to check.
        self.check_workers = getattr(engine.executor, "check_alive", lambda: None)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.stats_sent_at = 0.0

    def run(self) -> None:
        self.loop.run(self.receive, self.deliver)

    def receive(self, block: bool) -> bool:
        reply = CoreOutput()
        for msg in self._receive(block):
            if isinstance(msg, Shutdown):
                return False
            self._apply(msg, reply)
        if reply.added or reply.priorities or reply.states:
            self._send(reply)
        return True

    def deliver(self, outcome: StepOutcome) -> None:
        if outcome.fault:
            self._send(CoreOutput(failed=outcome.failed, stats=self._stats(force=True)))
            return
        for out in outcome.outputs:
            _wire_output(out)
        stats = self._stats(force=not self.engine.has_unfinished())
        if outcome.outputs or outcome.failed or stats is not None:
            self._send(CoreOutput(outcome.outputs, failed=outcome.failed, reasons=outcome.reasons, stats=stats))

    def _receive(self, block: bool) -> list[CoreInput]:
        """Every queued message (waiting for one if `block`); WorkerError if a rank died meanwhile."""
        while block and not self.inp.poll(IDLE_CHECK_MS):
            self.check_workers()
        messages = []
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            messages.append(self.decoder.decode(frame))

    def _send(self, msg: CoreOutput) -> None:
        self.out.send(self.encoder.encode(msg))

    def _apply(self, msg: CoreInput, reply: CoreOutput) -> None:
        if isinstance(msg, AddRequest):
            rid = msg.request.request_id
            try:
                self.loop.add(msg.request)
            except Exception as e:
                reply.added.append(AddReply(rid, _refusal(e, "add the request", rid)))
                return
            reply.added.append(AddReply(rid))
        elif isinstance(msg, SetPriority):
            try:
                live = self.loop.set_priority(msg.request_id, msg.priority)
            except Exception as e:
                reply.priorities.append(PriorityReply(msg.call_id, error=_refusal(e, "change the priority", msg.request_id)))
                return
            reply.priorities.append(PriorityReply(msg.call_id, live))
        elif isinstance(msg, StateQuery):
            try:
                reply.states.append(StateReply(msg.call_id, {**self.loop.state(), **_compiled_decode(self.engine)}))
            except Exception as e:  # a view must never take the engine down
                log.exception("engine failed to describe its state")
                reply.states.append(StateReply(msg.call_id, error=f"{type(e).__name__}: {e}"))
        elif isinstance(msg, Abort):
            self.loop.abort(msg.request_ids)

    def _stats(self, force: bool) -> EngineStats | None:
        now = time.monotonic()
        if not force and now - self.stats_sent_at < STATS_INTERVAL_S:
            return None
        self.stats_sent_at = now
        return read_stats(self.engine, self.loop.num_faults)
