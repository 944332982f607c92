"""The AsyncEngine loop: aborts within one iteration, no work while idle, and engine faults
(500 for the requests in flight, the server keeps going; /health 503 once the loop is dead)."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from serverkit import start_server, wait_idle
from tokenslice.config import CacheConfig, EngineConfig, ModelConfig
from tokenslice.engine.async_engine import AsyncEngine
from tokenslice.engine.protocol import MAX_CONSECUTIVE_FAULTS, EngineDeadError, EngineOverloadedError
from tokenslice.engine.engine import Engine
from tokenslice.plan import StepPlan, StepResult
from tokenslice.request import EngineRequest, InvalidRequestError, RequestOutput, SamplingParams

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_config(EngineConfig(model=ModelConfig(max_model_len=1024),
                                           cache=CacheConfig(kv_cache_blocks=64)))


def _until(pred: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # a failure deadline, not a performance check
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_abort_frees_kv_within_one_iteration(engine: Engine) -> None:
    async def main() -> None:
        seen: list[RequestOutput] = []  # every output the loop produced, delivered or not
        ae = AsyncEngine(engine, max_waiting=8, observer=seen.append)
        ae.start()
        try:
            stream = await ae.add_request(EngineRequest("long", engine.tokenize("abort me"),
                                                        SamplingParams(max_tokens=900, ignore_eos=True)))
            got = [await stream.__anext__() for _ in range(3)]
            assert all(o.new_token_ids for o in got)
            ae.abort(stream)
            await asyncio.to_thread(_until, lambda: bool(seen) and seen[-1].finished
                                    and ae.stats.device_blocks_used == 0 and ae.stats.num_running == 0)
            final = seen[-1]
            assert final.request_id == "long" and final.finish_reason == "abort"
            # The loop applies the abort before its next step: at most the step in flight ran.
            assert final.num_output_tokens <= got[-1].num_output_tokens + 1
            assert not engine.has_unfinished()
            kv = engine.scheduler.kv
            assert kv.num_free_device_blocks == kv.device.num_blocks
            # Idle: the loop blocks on its command queue and takes no steps.
            idle_steps = ae.stats.num_steps
            await asyncio.sleep(0.2)
            assert ae.stats.num_steps == idle_steps and ae.is_alive
        finally:
            ae.shutdown()
        assert not ae.is_alive

    asyncio.run(main())


def test_invalid_request_and_admission_limit(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=2)
        ae.start()
        try:
            with pytest.raises(InvalidRequestError) as exc:
                await ae.add_request(EngineRequest("too-long", [1] * 5000, SamplingParams(max_tokens=4)))
            assert exc.value.param == "prompt"
            assert ae.num_queued == 0
            assert "too-long" not in ae._outputs._tracked  # a refused request keeps no text state
            # Two admitted requests hold the queue until they produce output; a third is refused.
            a = asyncio.ensure_future(ae.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4))))
            b = asyncio.ensure_future(ae.add_request(EngineRequest("b", [1, 2, 3], SamplingParams(max_tokens=4))))
            await asyncio.sleep(0)  # both tasks enqueue; their first outputs cannot be back yet
            assert ae.num_queued == 2
            with pytest.raises(EngineOverloadedError):
                await ae.add_request(EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=4)))
            for s in await asyncio.gather(a, b):
                outs = [o async for o in s]
                assert outs[-1].finished and outs[-1].num_output_tokens <= 4
            assert ae.num_queued == 0
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_priority_update_goes_through_the_loop(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=8)
        with pytest.raises(EngineDeadError):
            await ae.set_priority("x", 1)
        ae.start()
        try:
            # The idle loop wakes for it; this engine's fcfs refuses a priority, and 0 finds nothing.
            with pytest.raises(InvalidRequestError) as exc:
                await ae.set_priority("x", 1)
            assert exc.value.param == "priority"
            assert await ae.set_priority("x", 0) is False
            stream = await ae.add_request(EngineRequest("live", [1, 2, 3], SamplingParams(max_tokens=900,
                                                                                         ignore_eos=True)))
            assert await ae.set_priority("live", 0) is True
            ae.abort(stream)
        finally:
            ae.shutdown()
        with pytest.raises(EngineDeadError):
            await ae.set_priority("live", 0)

    asyncio.run(main())


class FlakyExecutor:
    """Fault injection around the real executor: the next `fail` steps raise."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.fail = 0

    def execute(self, plan: StepPlan) -> StepResult:
        if self.fail > 0 and not plan.is_empty:
            self.fail -= 1
            raise RuntimeError("injected executor fault")
        return self.inner.execute(plan)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def test_engine_fault_is_500_then_server_recovers_or_reports_dead() -> None:
    with start_server("--kv-cache-blocks", "32", "--no-engine-process") as srv:  # swaps the engine's executor
        flaky = FlakyExecutor(srv.engine.executor)
        srv.engine.executor = flaky  # swapped while idle: the loop reads it at the next step
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0)

        flaky.fail = 1
        with pytest.raises(openai.InternalServerError) as exc:
            c.completions.create(model=MODEL, prompt="boom", max_tokens=4)
        assert exc.value.status_code == 500
        err = exc.value.body
        assert err["type"] == "server_error" and "request id cmpl-" in err["message"]

        flaky.fail = 1
        with pytest.raises(openai.APIError) as sexc:  # the stream carries an error event
            list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           stream=True))
        assert "request id chatcmpl-" in str(sexc.value)

        ok = c.completions.create(model=MODEL, prompt="fine", max_tokens=4)
        assert ok.usage.completion_tokens >= 1
        m = wait_idle(srv)
        assert m["tokenslice:engine_faults_total"] == 2
        assert httpx.get(srv.url("/health")).status_code == 200
        kv = srv.engine.scheduler.kv
        assert kv.num_free_device_blocks == kv.device.num_blocks

        # A run of failing steps means a broken engine: the loop stops and says so.
        flaky.fail = 10**6
        for _ in range(MAX_CONSECUTIVE_FAULTS):
            with pytest.raises(openai.APIStatusError) as exc:
                c.completions.create(model=MODEL, prompt="boom", max_tokens=4)
            assert exc.value.status_code in (500, 503)
        _until(lambda: httpx.get(srv.url("/health")).status_code == 503)
        with pytest.raises(openai.APIStatusError) as exc:
            c.completions.create(model=MODEL, prompt="anyone?", max_tokens=4)
        assert exc.value.status_code == 503 and exc.value.response.headers.get("Retry-After")
