"""The engine-core loop (engine/core.py) driven through real ZMQ sockets with its own messages:
replies, one output message per step, refusals, and engine faults (one fails the live requests,
a run of them ends the loop), with the real engine and fault injection around its executor."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from test_server_engine_loop import FlakyExecutor
from tokenslice.config import EngineConfig
from tokenslice.engine.protocol import MAX_CONSECUTIVE_FAULTS
from tokenslice.engine.core import EngineCore
from tokenslice.engine.core_messages import AddRequest, CoreMessage, CoreOutput, Shutdown
from tokenslice.engine.engine import Engine
from tokenslice.request import EngineRequest, SamplingParams

RECV_TIMEOUT_MS = 60_000  # a failure deadline, not a performance check


class Core:
    """An EngineCore on a thread, with the two sockets the API server would hold."""

    def __init__(self, engine: Engine) -> None:
        self.ctx = zmq.Context()
        self.to_core, self.from_core = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.to_core.bind("inproc://in")
        self.from_core.bind("inproc://out")
        core_in, core_out = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        core_in.connect("inproc://in")
        core_out.connect("inproc://out")
        self.sockets = [self.to_core, self.from_core, core_in, core_out]
        try:
            self.core = EngineCore(engine, core_in, core_out)
        except BaseException:
            # Open sockets would make the context's finalizer wait for ever (the test would hang).
            for sock in self.sockets:
                sock.close(linger=0)
            self.ctx.term()
            raise
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)

    def _run(self) -> None:
        try:
            self.core.run()
        except BaseException as e:  # noqa: BLE001 - kept for the test to inspect
            self.error = e

    def send(self, msg: object) -> None:
        self.to_core.send(msgspec.msgpack.encode(msg))

    def recv(self) -> CoreOutput:
        assert self.from_core.poll(RECV_TIMEOUT_MS), "the core sent nothing"
        msg = self.decoder.decode(self.from_core.recv())
        assert isinstance(msg, CoreOutput)
        return msg

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(Shutdown())
            self.thread.join(RECV_TIMEOUT_MS / 1000)
        for s in self.sockets:
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = Engine.from_config(EngineConfig.from_options(model="builtin:tiny", kv_cache_blocks=32, max_model_len=128))
    eng.detokenize = False
    yield eng
    eng.close()


def _add(core: Core, rid: str, prompt: list[int], max_tokens: int = 3) -> None:
    core.send(AddRequest(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))))


def test_core_replies_streams_steps_and_survives_one_fault(engine: Engine) -> None:
    flaky = FlakyExecutor(engine.executor)
    engine.executor = flaky
    core = Core(engine)
    try:
        _add(core, "a", [1, 2, 3])
        reply = core.recv()
        assert [(r.request_id, r.error) for r in reply.added] == [("a", None)] and not reply.outputs
        outputs = []
        while not (outputs and outputs[-1].finished):
            msg = core.recv()
            assert not msg.added and len(msg.outputs) <= 1  # one message per step
            outputs += msg.outputs
        assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
        assert outputs[-1].finish_reason == "length" and all(o.text_delta == "" for o in outputs)
        # Each output carries only its new token's time; the finished one carries the totals.
        assert [len(o.metrics.token_times) for o in outputs] == [1, 1, 1]
        assert outputs[-1].metrics.iterations == 3 and outputs[-1].metrics.finish_time is not None
        assert msg.stats is not None and msg.stats.num_running == 0  # idle: stats ride along

        _add(core, "long", [5] * 200)  # past the 128-token context: refused, as the server's 400
        err = core.recv().added[0].error
        assert err is not None and err.invalid and err.param == "prompt"

        flaky.fail = 1
        _add(core, "b", [1, 2])
        assert core.recv().added[0].error is None
        msg = core.recv()
        assert msg.failed == ["b"] and msg.stats is not None and msg.stats.num_faults == 1
        assert engine.scheduler.kv.num_free_device_blocks == engine.scheduler.kv.device.num_blocks
        _add(core, "c", [1, 2], max_tokens=1)
        assert core.recv().added[0].error is None
        assert core.recv().outputs[0].finished  # the engine recovered
    finally:
        core.close()
    assert core.error is None


def test_core_gives_up_after_a_run_of_faults(engine: Engine) -> None:
    flaky = FlakyExecutor(engine.executor)
    engine.executor = flaky
    flaky.fail = 10**6
    core = Core(engine)
    try:
        for i in range(MAX_CONSECUTIVE_FAULTS):
            _add(core, f"r{i}", [1, 2])
            assert core.recv().added[0].error is None
            assert core.recv().failed == [f"r{i}"]
        core.thread.join(RECV_TIMEOUT_MS / 1000)
        assert not core.thread.is_alive()
        assert isinstance(core.error, RuntimeError) and "in a row" in str(core.error)
    finally:
        core.close()
