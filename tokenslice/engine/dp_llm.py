"""The offline API's data parallelism (`LLM(..., data_parallel_size=N)`): the server's
DataParallelClient (N engine processes behind the router), driven from an event loop on a thread
of its own, so `generate` is a plain call that returns every prompt's completion in order."""
from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from tokenslice.config import EngineConfig
from tokenslice.engine.dp_client import DataParallelClient
from tokenslice.request import CompletionOutput, EngineRequest, RequestMetrics, SamplingParams, prompts_with_params


class DataParallelLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.client = DataParallelClient(config)
        self.tokenizer: Any = self.client.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenslice-dp-llm", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._call(self._start())

    async def _start(self) -> None:
        self.client.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """As Engine.generate: every prompt run to completion, results in prompt order."""
        return self._call(self._all(list(zip(*prompts_with_params(prompts, params), strict=True))))

    async def _all(self, work: list[tuple[str | list[int], SamplingParams]]) -> list[CompletionOutput]:
        return list(await asyncio.gather(*(self._one(p, sp) for p, sp in work)))

    async def _one(self, prompt: str | list[int], params: SamplingParams) -> CompletionOutput:
        ids = self.client.tokenize(prompt)
        rid = f"req-{next(self._ids)}"
        stream = await self.client.add_request(EngineRequest(rid, ids, params,
                                                             prompt_text=prompt if isinstance(prompt, str) else None))
        out = CompletionOutput(rid, prompt if isinstance(prompt, str) else None, ids, "", [], None, RequestMetrics())
        async for o in stream:
            out.text += o.text_delta
            out.token_ids += o.new_token_ids
            out.finish_reason = o.finish_reason or out.finish_reason
            out.metrics = o.metrics or out.metrics
        return out

    def close(self) -> None:
        self._call(self.client.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
