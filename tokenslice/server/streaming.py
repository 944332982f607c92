"""The streamed answer of both generation routes: one SSE generator over an API request's
choices, parametrised by the route's `StreamFormat` (how its chunks are rendered).

The stream ends with a usage chunk when asked (stream_options.include_usage), an error event if
the engine fails, and `data: [DONE]`. However it ends (finished, client gone, failed), its
unfinished choices are aborted, so their KV blocks are freed, and the request's line is logged.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenslice.engine.protocol import EngineClient, EngineDeadError, EngineFaultError
from tokenslice.request import RequestOutput
from tokenslice.server.choices import Choice, abort_unfinished, merged
from tokenslice.server.errors import engine_fault
from tokenslice.server.protocol import StreamOptions
from tokenslice.server.responses import ChatCompletionChunk, CompletionChunk, ErrorInfo, ErrorResponse
from tokenslice.server.sse import DONE, TextChunk, sse
from tokenslice.server.track import Track


class StreamFormat(ABC):
    """How a route renders its stream: the events before any output, the events of one output of
    a choice, and the final usage chunk. Subclasses name their chunk model and render their
    choice objects (render_text already runs in __init__: they set their own fields first);
    chunks carry the usage so far with stream_options.continuous_usage_stats."""

    chunk_model: type[CompletionChunk] | type[ChatCompletionChunk]

    def __init__(self, track: Track, created: int, model: str, num_choices: int,
                 options: StreamOptions | None) -> None:
        self.track = track
        self.created = created
        self.model = model
        self.include_usage = bool(options and options.include_usage)
        # As vLLM, continuous_usage_stats takes effect only together with include_usage.
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        # Chunks that differ only in their text are spliced into one rendering per choice.
        self.text_chunks = None if self.continuous else [
            TextChunk(functools.partial(self.render_text, k)) for k in range(num_choices)]

    def render(self, choice: Any) -> str:
        """JSON of a chunk holding one choice object."""
        return self.chunk_model(id=self.track.request_id, created=self.created, model=self.model, choices=[choice],
                                usage=self.track.usage if self.continuous else None).model_dump_json()

    def usage_chunk(self) -> str:
        """JSON of the last chunk: no choices, the usage of all."""
        return self.chunk_model(id=self.track.request_id, created=self.created, model=self.model, choices=[],
                                usage=self.track.usage).model_dump_json()

    def text_event(self, k: int, text: str) -> str:
        """The event of choice k's chunk that carries only text."""
        return self.text_chunks[k](text) if self.text_chunks else sse(self.render_text(k, text))

    @abstractmethod
    def render_text(self, k: int, text: str) -> str:
        """JSON of choice k's chunk that carries only `text`."""

    def opening(self, k: int) -> list[str]:
        """Events of choice k before any output."""
        return []

    @abstractmethod
    def events(self, k: int, choice: Choice, out: RequestOutput) -> list[str]:
        """Events of choice k's output `out` (already added to `choice`)."""


class EngineStreamResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends: finished, client
    disconnected (Starlette cancels the body iterator) or failed. That is where an
    unfinished request is aborted, so its KV blocks are freed."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def error_event(track: Track, e: BaseException) -> str:
    """The event that ends a stream the engine failed (its 200 was sent already)."""
    err = engine_fault(track.request_id, e)
    track.status = 500
    return sse(ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, code=err.code)).model_dump_json())


async def sse_events(choices: list[Choice], track: Track, fmt: StreamFormat) -> AsyncIterator[str]:
    """The stream: every choice's outputs as they arrive, rendered by `fmt`."""
    try:
        for k in range(len(choices)):
            for event in fmt.opening(k):
                yield event
        async for k, out in merged(choices):
            c = choices[k]
            c.add(out)
            track.account(choices)
            for event in fmt.events(k, c, out):
                yield event
        if fmt.include_usage:
            yield sse(fmt.usage_chunk())
    except (EngineFaultError, EngineDeadError) as e:
        yield error_event(track, e)
    yield DONE


def stream_response(engine: EngineClient, track: Track, choices: list[Choice], fmt: StreamFormat
                    ) -> EngineStreamResponse:
    def on_close() -> None:
        if not all(c.stream.finished for c in choices):
            abort_unfinished(engine, choices)
            track.outcome = "client disconnected; aborted"
        track.log()

    return EngineStreamResponse(sse_events(choices, track, fmt), on_close, track.request_id)
