"""Concurrency: clients that disconnect mid-stream, and more requests than --max-waiting admits."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai

from serverkit import start_server, wait_idle

MODEL = "builtin:tiny"


def test_disconnecting_streams_free_every_kv_block() -> None:
    # 48 blocks x 16 tokens cannot hold 200 requests at once: the scheduler also has to make
    # requests wait and preempt, so aborts land in every state.
    with start_server("--kv-cache-blocks", "48", "--max-model-len", "512", "--max-batch-size", "32") as srv:
        rng = random.Random(7)
        leavers = set(rng.sample(range(200), 200 // 3))
        finished: list[int] = []

        async def one(c: openai.AsyncOpenAI, i: int) -> None:
            # A leaver asks for many tokens: if its abort were lost, it would hold KV blocks
            # and show up as a finished ("length") request below.
            leave = i in leavers
            stream = await c.completions.create(model=MODEL, prompt=f"request {i}:", stream=True,
                                                max_tokens=400 if leave else 8, extra_body={"ignore_eos": True})
            got = 0
            async for chunk in stream:
                got += 1
                if leave and got >= 2:
                    await stream.close()  # drop the connection mid-stream
                    return
            finished.append(i)

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120) as c:
                await asyncio.gather(*(one(c, i) for i in range(200)))

        asyncio.run(main())
        assert sorted(finished) == sorted(set(range(200)) - leavers)

        m = wait_idle(srv)
        assert m["tokenslice:num_requests_running"] == 0
        assert m["tokenslice:kv_cache_usage_perc"] == 0
        stats = srv.server.async_engine.stats  # the engine core's KV and queues, as it last reported them
        assert stats.device_blocks_used == 0
        assert stats.num_running == stats.num_waiting == stats.num_preempted == 0
        assert m['tokenslice:request_success_total{finished_reason="length",model_name="builtin:tiny"}'] == \
            200 - len(leavers)
        assert m['tokenslice:request_success_total{finished_reason="abort",model_name="builtin:tiny"}'] == len(leavers)
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0)
        r = c.completions.create(model=MODEL, prompt="still there?", max_tokens=4)
        assert r.usage.completion_tokens >= 1
        assert m["tokenslice:num_preemptions_total"] > 0 or m["tokenslice:request_queue_time_seconds_sum"] > 0


def test_overload_gets_fast_429_and_health_stays_up() -> None:
    max_waiting = 4
    with start_server("--kv-cache-blocks", "64", "--max-batch-size", "2", "--max-waiting", str(max_waiting)) as srv:
        health_latencies: list[float] = []
        health_codes: list[int] = []

        async def poll_health(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient(timeout=60) as h:
                while not stop.is_set():
                    t0 = time.monotonic()
                    r = await h.get(srv.url("/health"))
                    health_latencies.append(time.monotonic() - t0)
                    health_codes.append(r.status_code)
                    await asyncio.sleep(0.02)

        async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, openai.APIStatusError | None]:
            try:
                r = await c.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=24,
                                               extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 24
                return "ok", None
            except openai.RateLimitError as e:
                return "429", e

        async def main() -> list[tuple[str, openai.APIStatusError | None]]:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(stop))
            async with openai.AsyncOpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120) as c:
                # 10x more than the server lets wait, all at once (plus the few it runs at a time).
                results = await asyncio.gather(*(one(c, i) for i in range(10 * max_waiting + 2)))
            stop.set()
            await poller
            return results

        results = asyncio.run(main())
        ok = [r for r in results if r[0] == "ok"]
        rejected = [e for kind, e in results if kind == "429"]
        print(f"admitted {len(ok)}, rejected {len(rejected)}, max health latency {max(health_latencies):.3f}s")
        assert ok and rejected, (len(ok), len(rejected))
        assert len(ok) + len(rejected) == len(results)
        for e in rejected:
            assert e is not None and e.status_code == 429
            assert int(e.response.headers["Retry-After"]) >= 1
            assert e.body["type"] == "rate_limit_error"
        assert health_codes and set(health_codes) == {200}  # answered throughout, never refused
        m = wait_idle(srv)
        assert m['tokenslice:request_rejected_total{model_name="builtin:tiny",status="429"}'] == len(rejected)
        assert httpx.get(srv.url("/health")).status_code == 200
