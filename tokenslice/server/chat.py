"""POST /v1/chat/completions: the messages rendered by the model's chat template, n choices, and
logprobs; streamed or not."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tokenslice.request import RequestOutput, TokenLogprobs
from tokenslice.server.choices import Choice, StopReasons, finish_reason, output_finish_reason
from tokenslice.server.errors import APIError
from tokenslice.server.generation_config import with_defaults
from tokenslice.server.logprobs import TokenTexts, chat_logprobs
from tokenslice.server.openapi import ok_doc
from tokenslice.server.prompts import message_text
from tokenslice.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                        ChatLogprobs, ChatMessageOut, ChatStreamChoice, DeltaMessage, StreamOptions)
from tokenslice.server.sampling import check_logprobs, check_stream_options, sampling_params
from tokenslice.server.serving import ClientWatch, Server
from tokenslice.server.sse import sse
from tokenslice.server.streaming import StreamFormat, stream_response
from tokenslice.server.track import Track, new_track


def add_chat_route(router: APIRouter, server: Server) -> None:
    @router.post("/chat/completions", response_model=None,
                 responses=ok_doc(ChatCompletionResponse, "A chat completion"))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async with ClientWatch(request) as client:
            return await create_chat_completion(server, body, request, client)


async def create_chat_completion(server: Server, body: ChatCompletionRequest, request: Request,
                                 client: ClientWatch) -> Response:
    track = new_track(request, "chatcmpl", "/v1/chat/completions")
    server.check_model(body.model)
    check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.tools:
        raise APIError(400, "tools are not supported", param="tools")
    check_logprobs(server.settings.max_logprobs, top_logprobs=body.top_logprobs)
    body = with_defaults(body, server.settings.default_sampling)
    ids = await run_in_threadpool(server.prompts.render_chat, body.messages, body.add_generation_prompt)
    requested = body.max_completion_tokens or body.max_tokens
    server.prompts.check_room(ids, requested, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    # Without a limit, a chat reply may use the rest of the context (the engine stops there), or
    # the generation config's max_new_tokens within it.
    room = max(1, server.info.max_model_len - len(ids))
    default = server.settings.default_sampling.get("max_tokens")
    params = sampling_params(body, server.info, requested or (min(default, room) if default else room),
                             (body.top_logprobs or 0) if body.logprobs else None)
    choices = await server.submit_choices(track, [ids], params, body.n, body, [message_text(body.messages)], client)
    model, created = server.settings.served_model_name, int(time.time())
    texts = TokenTexts(server.logprob_tokenizer) if body.logprobs else None
    stops = StopReasons.for_request(body, server.tokenizer)

    if body.stream:
        stream = ChatStream(track, created, model, len(choices), body.stream_options, texts, stops)
        return stream_response(server.async_engine, track, choices, stream)

    await server.collect(choices, client, track)
    resp = ChatCompletionResponse(id=track.request_id, created=created, model=model, usage=track.usage, choices=[
        ChatChoice(index=k, message=ChatMessageOut(content=c.text), logprobs=_logprobs(texts, c, c.logprobs),
                   finish_reason=finish_reason(c.finish_reason), stop_reason=stops.of(c))
        for k, c in enumerate(choices)])
    track.log()
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": track.request_id})


def _logprobs(texts: TokenTexts | None, c: Choice, new: TokenLogprobs | None) -> ChatLogprobs | None:
    """Logprobs of choice c's last len(new) tokens; None unless asked for (texts given)."""
    if texts is None or new is None:
        return None
    context = c.prompt_token_ids + c.token_ids
    return chat_logprobs(texts, context[-len(new) - 1], new)


class ChatStream(StreamFormat):
    """A streamed chat completion: each choice opens with the assistant role, then one chunk per
    generated token, then an empty delta that carries the finish reason."""

    chunk_model = ChatCompletionChunk

    def __init__(self, track: Track, created: int, model: str, num_choices: int, options: StreamOptions | None,
                 texts: TokenTexts | None, stops: StopReasons) -> None:
        self.texts = texts
        self.stops = stops
        super().__init__(track, created, model, num_choices, options)

    def chunk(self, k: int, delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None,
              stop_reason: int | str | None = None) -> str:
        return sse(self.render(ChatStreamChoice(index=k, delta=delta, logprobs=lps, finish_reason=finish,
                                                stop_reason=stop_reason)))

    def render_text(self, k: int, text: str) -> str:
        return self.render(ChatStreamChoice(index=k, delta=DeltaMessage(content=text)))

    def opening(self, k: int) -> list[str]:
        return [self.chunk(k, DeltaMessage(role="assistant", content=""))]

    def events(self, k: int, choice: Choice, out: RequestOutput) -> list[str]:
        events = []
        if out.text_delta or out.new_token_ids:  # one chunk per generated token, as vLLM streams
            lps = _logprobs(self.texts, choice, out.logprobs)
            events.append(self.text_event(k, out.text_delta) if lps is None
                          else self.chunk(k, DeltaMessage(content=out.text_delta), None, lps))
        if out.finished:
            finish = output_finish_reason(out)
            events.append(self.chunk(k, DeltaMessage(), finish, stop_reason=self.stops.of(choice) if finish else None))
        return events
