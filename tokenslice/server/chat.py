"""POST /v1/chat/completions: the messages rendered by the model's chat template, n choices,
logprobs and tool calls (server/tools.py); streamed or not."""
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
from tokenslice.server.protocol import ChatCompletionRequest, StreamOptions
from tokenslice.server.responses import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                                         ChatMessageOut, ChatStreamChoice, DeltaMessage, FunctionCallDelta,
                                         ToolCallDelta, ToolCallOut)
from tokenslice.server.sampling import check_logprobs, check_stream_options, sampling_params
from tokenslice.server.serving import ClientWatch, Server
from tokenslice.server.structured import structured_output
from tokenslice.server.sse import sse
from tokenslice.server.streaming import StreamFormat, stream_response
from tokenslice.server.tools import ToolCallParser, calls_tools, check_tool_fields, parse_tool_calls, tool_grammar
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
    check_tool_fields(body)
    check_logprobs(server.settings.max_logprobs, top_logprobs=body.top_logprobs)
    body = with_defaults(body, server.settings.default_sampling)
    ids = await run_in_threadpool(server.prompts.render_chat, body.messages, body.add_generation_prompt, False,
                                  body.tools)
    requested = body.max_completion_tokens or body.max_tokens
    server.prompts.check_room(ids, requested, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    # Without a limit, a chat reply may use the rest of the context (the engine stops there), or
    # the generation config's max_new_tokens within it.
    room = max(1, server.info.max_model_len - len(ids))
    default = server.settings.default_sampling.get("max_tokens")
    params = sampling_params(body, server.info, requested or (min(default, room) if default else room),
                             (body.top_logprobs or 0) if body.logprobs else None)
    # Off the event loop: the first grammar check imports xgrammar (and torch).
    params.structured = await run_in_threadpool(tool_grammar, body) if calls_tools(body) else (
        await structured_output(body))
    choices = await server.submit_choices(track, [ids], params, body.n, body, [message_text(body.messages)], client)
    model, created = server.settings.served_model_name, int(time.time())
    texts = TokenTexts(server.logprob_tokenizer) if body.logprobs else None
    stops = StopReasons.for_request(body, server.tokenizer)

    if body.stream:
        stream = ChatStream(track, created, model, len(choices), body.stream_options, texts, stops, calls_tools(body))
        return stream_response(server.async_engine, track, choices, stream)

    await server.collect(choices, client, track)
    resp = ChatCompletionResponse(id=track.request_id, created=created, model=model, usage=track.usage, choices=[
        _choice(k, c, calls_tools(body), _logprobs(texts, c, c.logprobs), stops) for k, c in enumerate(choices)])
    track.log()
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": track.request_id})


def _choice(k: int, c: Choice, with_calls: bool, lps: ChatLogprobs | None, stops: StopReasons) -> ChatChoice:
    """Choice k of the answer; `with_calls`: its <tool_call> blocks parsed out of the text."""
    content, calls = parse_tool_calls(c.text) if with_calls else (c.text, [])
    return ChatChoice(index=k, message=ChatMessageOut(content=content, tool_calls=calls), logprobs=lps,
                      finish_reason=_finish(c.finish_reason, bool(calls)), stop_reason=stops.of(c))


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after making calls."""
    return "tool_calls" if called and reason == "stop" else finish_reason(reason)


def _logprobs(texts: TokenTexts | None, c: Choice, new: TokenLogprobs | None) -> ChatLogprobs | None:
    """Logprobs of choice c's last len(new) tokens; None unless asked for (texts given)."""
    if texts is None or new is None:
        return None
    context = c.prompt_token_ids + c.token_ids
    return chat_logprobs(texts, context[-len(new) - 1], new)


class ChatStream(StreamFormat):
    """A streamed chat completion: each choice opens with the assistant role, then one chunk per
    generated token, then an empty delta that carries the finish reason. With tool calls, text that
    may begin a call is held back, and each call comes whole in one chunk once its block closes."""

    chunk_model = ChatCompletionChunk

    def __init__(self, track: Track, created: int, model: str, num_choices: int, options: StreamOptions | None,
                 texts: TokenTexts | None, stops: StopReasons, with_calls: bool = False) -> None:
        self.texts = texts
        self.stops = stops
        self.parsers = [ToolCallParser() for _ in range(num_choices)] if with_calls else None
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
        if self.parsers is not None:
            events = self._call_events(k, choice, out)
        elif out.text_delta or out.new_token_ids:  # one chunk per generated token, as vLLM streams
            lps = _logprobs(self.texts, choice, out.logprobs)
            events.append(self.text_event(k, out.text_delta) if lps is None
                          else self.chunk(k, DeltaMessage(content=out.text_delta), None, lps))
        if out.finished:
            finish = output_finish_reason(out)
            called = self.parsers is not None and self.parsers[k].num_calls > 0
            events.append(self.chunk(k, DeltaMessage(), _finish(finish, called) if finish else None,
                                     stop_reason=self.stops.of(choice) if finish else None))
        return events

    def _call_events(self, k: int, choice: Choice, out: RequestOutput) -> list[str]:
        """Choice k's content released by `out` and the calls it closed, in order; the token's
        logprobs ride on the first chunk (an empty content one if nothing was released)."""
        assert self.parsers is not None
        parser = self.parsers[k]
        first_call = parser.num_calls
        items = parser.feed(out.text_delta) + (parser.finish() if out.finished else [])
        lps = _logprobs(self.texts, choice, out.logprobs) if out.new_token_ids else None
        deltas = []
        for item in items:
            if isinstance(item, ToolCallOut):
                deltas.append(DeltaMessage(tool_calls=[ToolCallDelta(
                    index=first_call, id=item.id, type="function",
                    function=FunctionCallDelta(name=item.function.name, arguments=item.function.arguments))]))
                first_call += 1
            elif deltas and deltas[-1].content is not None:
                deltas[-1].content += item
            else:
                deltas.append(DeltaMessage(content=item))
        if lps is not None and not deltas:
            deltas.append(DeltaMessage(content=""))
        events = []
        for i, delta in enumerate(deltas):
            if i == 0 and lps is not None:
                events.append(self.chunk(k, delta, None, lps))
            elif delta.content is not None:
                events.append(self.text_event(k, delta.content))
            else:
                events.append(self.chunk(k, delta))
        return events
