"""FastAPI app: OpenAI-compatible routes over an engine client (docs/DESIGN.md, Data flow).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/requests/{id}/priority,
GET /v1/models[/{id}], GET /v1/state[/stream] (the live view's data, server/state.py),
POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /version, GET /metrics, and
the live view's page GET /dashboard (server/dashboard.py). Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
/v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` when an API key is set;
/health, /ping, /version, /metrics and /dashboard (a page without data) stay open so that
probes and scrapers need no secret.

One log line per generation request (id, tokens, finish reason, latency); prompt and output
text are never logged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import importlib.metadata
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenslice.engine.protocol import (EngineClient, EngineDeadError, EngineFaultError, EngineInfo,
                                        EngineOverloadedError, RequestStream)
from tokenslice.request import (MAX_LOGIT_BIAS, EngineRequest, InvalidRequestError, RequestOutput, SamplingParams,
                                TokenLogprobs)
from tokenslice.server.choices import Choice, best_of, merged, sibling_seed
from tokenslice.server.dashboard import add_dashboard
from tokenslice.server.logprobs import (TokenTexts, chat_logprobs, completion_logprobs, echo_completion_logprobs,
                                        prompt_logprob_entries)
from tokenslice.server.metrics import ServerMetrics
from tokenslice.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatMessage, ChatMessageOut,
                                        ChatStreamChoice, CompletionLogprobs,
                                        CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse,
                                        DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo,
                                        ErrorResponse, ModelCard, ModelList, PriorityResponse, PriorityUpdate,
                                        SamplingFields, TokenizeRequest, TokenizeResponse, UsageInfo,
                                        VersionResponse)
from tokenslice.server.settings import ServerSettings
from tokenslice.server.state import StateHub, encode as encode_state

log = logging.getLogger("tokenslice.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Temperatures below this sample greedily: dividing logits by ~0 would overflow to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
# The sampler divides float32 logits by the temperature; one past float32's range becomes inf
# (and -inf/inf is NaN). Sampling at this temperature is already uniform for practical purposes.
MAX_TEMPERATURE = 1e4
# The sampler compares top_p in float32; a smaller top_p rounds to 0 and would drop every token.
# Any top_p this small keeps only the most likely token anyway.
MIN_TOP_P = 1e-6
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # of an oversized body, read and dropped before the 413
# Besides /v1/*, the routes that need the API key: they spend tokenizer time on the caller's text.
KEYED_PATHS = ("/tokenize", "/detokenize")


def package_version() -> str:
    try:
        return importlib.metadata.version("tokenslice")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


class APIError(Exception):
    """An error to send as OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def _error_type(status: int) -> str:
    return _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


# ---- ASGI middleware (pure ASGI: BaseHTTPMiddleware would break disconnect detection) ------------
class APIKeyMiddleware:
    """401 on /v1/* without `Authorization: Bearer <key>`; other paths stay open. The scheme is
    case-insensitive (RFC 7235 §2.1)."""

    def __init__(self, app: ASGIApp, api_key: str | None, on_reject: Callable[[int], None]) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (self.expected is None or scope["type"] != "http"
                or not (path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS)):
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected):  # constant time: no key guessing by timing
            await self.app(scope, receive, send)
            return
        self.on_reject(401)
        resp = error_response(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over the limit. The body is read here (it would be buffered by
    the JSON parser anyway) and replayed to the app; the original `receive` then stays
    available so handlers can notice a disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            # Not worth draining a body that would overrun the bound anyway: answer at once.
            await self._too_large(scope, receive, send, more_body=int(length) <= DRAIN_LIMIT_BYTES)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, more_body=msg.get("more_body", False))
                return
            if not msg.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, more_body: bool = True) -> None:
        # Most HTTP/1.1 clients send the whole body before reading the answer: closing on them
        # mid-upload shows up as a reset connection, not a 413. So read and drop the rest, up
        # to a bound past which the connection is simply closed after the answer.
        drained = 0
        while more_body and drained <= DRAIN_LIMIT_BYTES:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            drained += len(msg.get("body", b""))
            more_body = msg.get("more_body", False)
        self.on_reject(413)
        resp = error_response(413, f"request body is larger than {self.max_bytes} bytes", code="request_too_large",
                              headers={"Connection": "close"})
        await resp(scope, receive, send)


class UnexpectedErrorMiddleware:
    """Answers an unexpected exception with the 500 error object and keeps the connection.

    Starlette's outermost error handler re-raises after answering, and uvicorn then resets a
    kept-alive connection, failing the client's next, valid request too. Caught here instead,
    unless the response had already started (then there is nothing left to answer)."""

    def __init__(self, app: ASGIApp, handler: Callable[[Request, Exception], Any]) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            resp = await self.handler(Request(scope, receive), exc)
            await resp(scope, receive, send)


# ---- per-request bookkeeping --------------------------------------------------------------------
@dataclass
class _Track:
    """What the request log line reports; updated as outputs arrive."""

    request_id: str
    route: str
    start: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    outcome: str = "ok"

    def account(self, choices: list[Choice]) -> None:
        """Usage of all choices: each prompt counted once (set at submission), every generated token."""
        self.completion_tokens = sum(c.num_output_tokens for c in choices)
        reasons = sorted({c.finish_reason for c in choices if c.finish_reason})
        self.finish_reason = ",".join(reasons) or None

    def log(self) -> None:
        log.info("%s %s status=%d prompt_tokens=%d completion_tokens=%d finish=%s latency=%.3fs%s",
                 self.request_id, self.route, self.status, self.prompt_tokens, self.completion_tokens,
                 self.finish_reason, time.monotonic() - self.start,
                 "" if self.outcome == "ok" else f" ({self.outcome})")

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)


class _EngineStreamResponse(StreamingResponse):
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


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


_DONE = "data: [DONE]\n\n"
_TEXT_MARK = "tokenslice-text-mark"


class _TextChunk:
    """SSE events of a stream's chunks that differ only in their text: pydantic renders the chunk
    once, and each token's text is spliced into that JSON (one string escape per token instead of
    building and dumping models; the JSON means the same)."""

    def __init__(self, render: Callable[[str], str]) -> None:
        self.render = render
        page, mark = render(_TEXT_MARK), json.dumps(_TEXT_MARK)
        head, _, tail = page.partition(mark)
        self.parts = (head, tail) if page.count(mark) == 1 else None

    def __call__(self, text: str) -> str:
        if self.parts is None:
            return _sse(self.render(text))
        return f"data: {self.parts[0]}{json.dumps(text, ensure_ascii=False)}{self.parts[1]}\n\n"


async def _wait_disconnect(request: Request) -> None:
    # The body was read already, so the next message the server delivers is the disconnect.
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


# ---- the server ---------------------------------------------------------------------------------
class Server:
    """Request handling shared by the routes; holds the engine client and the metrics."""

    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.settings = settings
        self.async_engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(settings.served_model_name, lambda: self.async_engine.stats,
                                     lambda: self.async_engine.num_queued)
        self.async_engine.observer = self.metrics.observe
        self.state = StateHub(engine, self.metrics)

    # ---- request -> engine inputs ---------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(400, f"model {model!r} is not served here; available: {self.settings.served_model_name!r}",
                           param="model", code="model_not_found")

    @staticmethod
    def refuse_unsupported(body: SamplingFields) -> None:
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else min(temperature, MAX_TEMPERATURE),
            top_p=1.0 if body.top_p is None else max(body.top_p, MIN_TOP_P), top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed, stop=stop, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias), min_p=body.min_p or 0.0,
            stop_token_ids=list(body.stop_token_ids or []), include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            params.validate()
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        # No request can outgrow the context, so larger limits mean the same; clamping keeps
        # absurd JSON integers out of the policies' arithmetic.
        cap = self.info.max_model_len
        params.max_tokens = min(params.max_tokens, cap)
        params.min_tokens = min(params.min_tokens, cap)
        # top_k at or past the vocabulary keeps every token; clamped, it also fits the core's 64-bit messages.
        params.top_k = min(params.top_k, self.info.vocab_size)
        return params

    def check_room(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        """An explicit output limit must fit the context after the prompt, as vLLM checks it; a
        prompt that leaves no room at all is the engine's error (param "prompt")."""
        limit = self.info.max_model_len
        if max_tokens is not None and len(ids) < limit and len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's context is {limit} tokens, but {len(ids) + max_tokens} were requested "
                                f"({len(ids)} in the prompt, {max_tokens} for the completion); lower {param} to at "
                                f"most {limit - len(ids)} or shorten the prompt", param=param)

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """More characters than this cannot fit the context whatever the tokenizer does.

        Tokenizing a body-limit-sized prompt takes seconds of CPU; this refuses hopeless ones
        first. No token spells more characters than its longest vocabulary entry; the factor 4
        leaves room for normalizers that merge characters."""
        tok = self.tokenizer
        if tok is None:
            return None
        longest = max((len(t) for t in tok.get_vocab()), default=1)
        return self.info.max_model_len * max(1, longest) * 4

    def _check_length(self, text: str, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"{param} has {len(text)} characters, more than this model's context of "
                                f"{self.info.max_model_len} tokens can hold", param=param)

    def tokenize_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self._check_length(prompt, "prompt")
        tok = self.tokenizer
        if not add_special_tokens and tok is not None:  # /tokenize only: the engine always adds them
            return list(tok(prompt, add_special_tokens=False)["input_ids"])
        try:
            return self.async_engine.tokenize(prompt)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False) -> list[int]:
        """Messages -> token ids through the model's chat template."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, f"model {self.settings.served_model_name!r} has no chat template, so it cannot "
                                "serve /v1/chat/completions; use /v1/completions with a plain prompt",
                           param="messages", code="chat_template_missing")
        conversation = []
        for i, m in enumerate(messages):
            entry: dict[str, Any] = {"role": m.role, "content": self._message_text(m, i)}
            if m.name is not None:
                entry["name"] = m.name
            conversation.append(entry)
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        self._check_length(text, "messages")
        # The template already places any special tokens (BOS) it wants.
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    @staticmethod
    def _message_text(m: ChatMessage, i: int) -> str:
        if m.content is None or isinstance(m.content, str):
            return m.content or ""
        parts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                               param="messages")
            parts.append(part.text)
        return "".join(parts)

    async def submit(self, track: _Track, request_id: str, prompt: list[int], params: SamplingParams,
                     body: SamplingFields, prefix_leader: str | None = None) -> RequestStream:
        try:
            return await self.async_engine.add_request(EngineRequest(
                request_id, prompt, params, arrival_time=track.start, user=body.user, priority=body.priority,
                expected_output_tokens=body.tokenslice.expected_output_tokens if body.tokenslice else None,
                prefix_leader=prefix_leader))
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineOverloadedError:
            raise APIError(429, f"server overloaded: more than {self.settings.max_waiting} requests are waiting; "
                                "retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except EngineFaultError as e:
            raise self.fault(track.request_id, e) from None

    async def submit_choices(self, track: _Track, prompts: list[list[int]], params: SamplingParams, copies: int,
                             body: SamplingFields) -> list[Choice]:
        """`copies` engine requests per prompt, each its own scheduled request: the request id for
        a single one, `{id}-{k}` (k = prompt index x copies + i) for several. All or none."""
        track.prompt_tokens = sum(len(p) for p in prompts)  # streamed usage may be sent before any output
        single = len(prompts) * copies == 1
        choices: list[Choice] = []
        try:
            for pi, ids in enumerate(prompts):
                for i in range(copies):
                    rid = track.request_id if single else f"{track.request_id}-{pi * copies + i}"
                    sp = dataclasses.replace(params, seed=sibling_seed(params.seed, i))
                    # Siblings start from the first one's prompt KV (prefix cache) instead of recomputing it.
                    leader = choices[pi * copies].stream.request_id if i else None
                    choices.append(Choice(pi, ids, await self.submit(track, rid, ids, sp, body, leader)))
        except BaseException:
            self.abort_all(choices)
            raise
        return choices

    def abort_all(self, choices: list[Choice]) -> None:
        for c in choices:
            if not c.stream.finished:
                self.async_engine.abort(c.stream)

    @staticmethod
    def fault(request_id: str, e: BaseException) -> APIError:
        log.error("%s failed in the engine: %s", request_id, e)
        if isinstance(e, EngineDeadError):  # the server is done for: say why (e.g. which worker died), in one line
            why = (str(e).splitlines() or [type(e).__name__])[0]
            return APIError(500, f"the engine stopped: {why} (request id {request_id})", type="server_error",
                            code="engine_error")
        return APIError(500, f"internal engine error (request id {request_id})", type="server_error",
                        code="engine_error")

    async def collect(self, choices: list[Choice], request: Request, track: _Track) -> None:
        """Run non-streamed choices to their end; abort them all if the client disconnects first."""
        async def consume() -> None:
            async for k, out in merged(choices):
                choices[k].add(out)
                track.account(choices)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                self.abort_all(choices)
        if consumer not in done:
            track.outcome = "client disconnected; aborted"
            track.log()
            raise _ClientGone()
        try:
            consumer.result()
        except (EngineFaultError, EngineDeadError) as e:
            raise self.fault(track.request_id, e) from None

    def streaming(self, track: _Track, choices: list[Choice], events: AsyncIterator[str]) -> _EngineStreamResponse:
        def on_close() -> None:
            if not all(c.stream.finished for c in choices):
                self.abort_all(choices)
                track.outcome = "client disconnected; aborted"
            track.log()

        return _EngineStreamResponse(events, on_close, track.request_id)

    def error_event(self, track: _Track, e: BaseException) -> str:
        err = self.fault(track.request_id, e)
        track.status = 500
        return _sse(ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, code=err.code))
                    .model_dump_json())

    # ---- routes ----------------------------------------------------------------------------
    def completion_params(self, body: CompletionRequest) -> tuple[SamplingParams, int]:
        """The engine's sampling params of every choice, and how many to generate per prompt."""
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        copies = body.best_of or body.n
        if copies < body.n:
            raise APIError(400, f"best_of must be at least n ({body.n}), got {copies}", param="best_of")
        if body.stream and copies > body.n:
            raise APIError(400, "best_of > n cannot be streamed: the best are known only at the end", param="best_of")
        if body.stream and body.prompt_logprobs is not None and not body.echo:
            raise APIError(400, "prompt_logprobs cannot be streamed; use echo with logprobs, or stream false",
                           param="prompt_logprobs")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 is only allowed with echo (the prompt and its logprobs)",
                           param="max_tokens")
        # best_of ranks by the sampled tokens' cumulative logprob: computed even if not asked for.
        logprobs = body.logprobs if body.logprobs is not None else (0 if copies > body.n else None)
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else (0 if max_tokens == 0 else None)
        return self.sampling_params(body, max_tokens, logprobs, prompt_logprobs), copies

    def completion_choice(self, index: int, c: Choice, prompt: str | list[int], body: CompletionRequest,
                          texts: TokenTexts) -> CompletionChoice:
        echo = self.echo_text(prompt, c.prompt_token_ids) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = (echo_completion_logprobs(texts, c.prompt_token_ids, c.prompt_logprobs, c.logprobs, len(echo))
                        if body.echo else completion_logprobs(texts, c.prompt_token_ids[-1], c.logprobs, 0))
        prompt_lps = (prompt_logprob_entries(texts, c.prompt_token_ids, c.prompt_logprobs)
                      if body.prompt_logprobs is not None else None)
        return CompletionChoice(index=index, text=echo + c.text, logprobs=logprobs,
                                finish_reason=_finish_reason(c.finish_reason), prompt_logprobs=prompt_lps)

    def echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer else ""  # accepted ids decode

    # ---- routes ----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        track = self.new_track(request, "cmpl", "/v1/completions")
        self.check_model(body.model)
        self.refuse_unsupported(body)
        params, copies = self.completion_params(body)
        prompts = _prompt_list(body.prompt)
        ids = [await run_in_threadpool(self.tokenize_prompt, p) if isinstance(p, str) else p for p in prompts]
        for one in ids:
            self.check_room(one, body.max_tokens, "max_tokens")
        choices = await self.submit_choices(track, ids, params, copies, body)
        model, created = self.settings.served_model_name, int(time.time())
        texts = TokenTexts(self.tokenizer)

        if body.stream:
            include_usage, continuous = _usage_options(body)

            def render(k: int, text: str, finish: str | None = None, logprobs: CompletionLogprobs | None = None) -> str:
                return CompletionChunk(id=track.request_id, created=created, model=model, choices=[
                    CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=finish)],
                    usage=track.usage if continuous else None).model_dump_json()

            # Chunks that differ only in their text are spliced into one rendering per choice.
            text_chunks = None if continuous else [_TextChunk(functools.partial(render, k)) for k in range(len(choices))]

            def chunk(k: int, text: str, finish: str | None, logprobs: CompletionLogprobs | None = None) -> str:
                if text_chunks and finish is None and logprobs is None:
                    return text_chunks[k](text)
                return _sse(render(k, text, finish, logprobs))

            async def events() -> AsyncIterator[str]:
                sent = [0] * len(choices)  # characters of each choice's text sent (text_offset)
                try:
                    async for k, out in merged(choices):
                        c = choices[k]
                        c.add(out)
                        track.account(choices)
                        if body.echo and sent[k] == 0 and c.num_output_tokens == len(out.new_token_ids):
                            # The prompt first, once its logprobs are in (they come with the first output).
                            echoed = self.completion_choice(k, dataclasses.replace(c, text="", logprobs=TokenLogprobs()),
                                                            prompts[c.prompt_index], body, texts)
                            sent[k] = len(echoed.text)
                            yield chunk(k, echoed.text, None, echoed.logprobs)
                        # One chunk per generated token (as vLLM streams), even when the text is
                        # held back: clients time every token and count them against usage.
                        if out.text_delta or out.new_token_ids or out.finished:
                            lps = None
                            if body.logprobs is not None and out.logprobs is not None:
                                context = c.prompt_token_ids + c.token_ids
                                lps = completion_logprobs(texts, context[-len(out.new_token_ids) - 1], out.logprobs,
                                                          sent[k])
                            sent[k] += len(out.text_delta)
                            yield chunk(k, out.text_delta, _finish(out), lps)
                    if include_usage:
                        yield _sse(CompletionChunk(id=track.request_id, created=created, model=model, choices=[],
                                                   usage=track.usage).model_dump_json())
                except (EngineFaultError, EngineDeadError) as e:
                    yield self.error_event(track, e)
                yield _DONE

            return self.streaming(track, choices, events())

        await self.collect(choices, request, track)
        kept = best_of(choices, body.n) if copies > body.n else choices
        resp = CompletionResponse(id=track.request_id, created=created, model=model, usage=track.usage, choices=[
            self.completion_choice(k, c, prompts[c.prompt_index], body, texts) for k, c in enumerate(kept)])
        track.log()
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": track.request_id})

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        track = self.new_track(request, "chatcmpl", "/v1/chat/completions")
        self.check_model(body.model)
        self.refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        ids = await run_in_threadpool(self.render_chat, body.messages, body.add_generation_prompt)
        requested = body.max_completion_tokens or body.max_tokens
        self.check_room(ids, requested, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        # Without a limit, a chat reply may use the rest of the context (the engine stops there).
        params = self.sampling_params(body, requested or max(1, self.info.max_model_len - len(ids)),
                                      (body.top_logprobs or 0) if body.logprobs else None)
        choices = await self.submit_choices(track, [ids], params, body.n, body)
        model, created = self.settings.served_model_name, int(time.time())
        texts = TokenTexts(self.tokenizer)

        def logprobs(c: Choice, new: TokenLogprobs | None) -> ChatLogprobs | None:
            if not body.logprobs or new is None:
                return None
            context = c.prompt_token_ids + c.token_ids
            return chat_logprobs(texts, context[-len(new) - 1], new)

        if body.stream:
            include_usage, continuous = _usage_options(body)

            def render(k: int, delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None) -> str:
                return ChatCompletionChunk(id=track.request_id, created=created, model=model, choices=[
                    ChatStreamChoice(index=k, delta=delta, logprobs=lps, finish_reason=finish)],
                    usage=track.usage if continuous else None).model_dump_json()

            def chunk(k: int, delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None) -> str:
                return _sse(render(k, delta, finish, lps))

            text_chunks = None if continuous else [
                _TextChunk(lambda text, k=k: render(k, DeltaMessage(content=text))) for k in range(len(choices))]

            async def events() -> AsyncIterator[str]:
                try:
                    for k in range(len(choices)):
                        yield chunk(k, DeltaMessage(role="assistant", content=""))
                    async for k, out in merged(choices):
                        c = choices[k]
                        c.add(out)
                        track.account(choices)
                        if out.text_delta or out.new_token_ids:  # one chunk per token, as above
                            lps = logprobs(c, out.logprobs)
                            yield (text_chunks[k](out.text_delta) if text_chunks and lps is None
                                   else chunk(k, DeltaMessage(content=out.text_delta), None, lps))
                        if out.finished:
                            yield chunk(k, DeltaMessage(), _finish(out))
                    if include_usage:
                        yield _sse(ChatCompletionChunk(id=track.request_id, created=created, model=model, choices=[],
                                                       usage=track.usage).model_dump_json())
                except (EngineFaultError, EngineDeadError) as e:
                    yield self.error_event(track, e)
                yield _DONE

            return self.streaming(track, choices, events())

        await self.collect(choices, request, track)
        resp = ChatCompletionResponse(id=track.request_id, created=created, model=model, usage=track.usage, choices=[
            ChatChoice(index=k, message=ChatMessageOut(content=c.text), logprobs=logprobs(c, c.logprobs),
                       finish_reason=_finish_reason(c.finish_reason)) for k, c in enumerate(choices)])
        track.log()
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": track.request_id})

    async def set_priority(self, request_id: str, body: PriorityUpdate) -> PriorityResponse:
        """A live request's new priority, applied before the next step (FastSwitch)."""
        try:
            live = await self.async_engine.set_priority(request_id, body.priority)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except EngineFaultError as e:
            raise self.fault(request_id, e) from None
        if not live:
            raise APIError(404, f"no live request {request_id!r}: it finished, was aborted or never existed",
                           code="request_not_found")
        log.info("%s priority=%d", request_id, body.priority)
        return PriorityResponse(id=request_id, priority=body.priority)

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.settings.served_model_name, max_model_len=self.info.max_model_len)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: what the completion and chat routes would feed the engine."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = await run_in_threadpool(self.render_chat, body.messages, body.add_generation_prompt,
                                          bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await run_in_threadpool(self.tokenize_prompt, body.prompt, special)
        return TokenizeResponse(count=len(ids), max_model_len=self.info.max_model_len, tokens=ids)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        tok = self.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{self.info.vocab_size - 1})",
                           param="tokens")
        return DetokenizeResponse(prompt=await run_in_threadpool(tok.decode, body.tokens))

    @staticmethod
    def new_track(request: Request, prefix: str, route: str) -> _Track:
        track = _Track(f"{prefix}-{uuid.uuid4().hex}", route, time.monotonic())
        request.state.track = track  # the error handlers log with it
        return track


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list of prompts: a string, a token-id list, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as string keys (JSON objects have no others)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):  # int() of a huge digit string is costly
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _usage_options(body: SamplingFields) -> tuple[bool, bool]:
    """(usage chunk at the end, usage so far on every chunk). As vLLM, continuous_usage_stats
    takes effect only together with include_usage."""
    opts = body.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)


def _finish_reason(reason: str | None) -> str | None:
    # The engine says "abort" only for requests whose client already left.
    return reason if reason in ("stop", "length") else ("length" if reason else None)


def _finish(out: RequestOutput) -> str | None:
    return _finish_reason(out.finish_reason) if out.finished else None


# ---- app factory ----------------------------------------------------------------------------------
def _error_docs() -> dict[int | str, dict[str, Any]]:
    # Built per app: FastAPI keeps references into these while generating the schema.
    return {
        400: {"model": ErrorResponse, "description": "Invalid request"},
        401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
        413: {"model": ErrorResponse, "description": "Request body too large"},
        429: {"model": ErrorResponse, "description": "Too many requests waiting; see Retry-After"},
        500: {"model": ErrorResponse, "description": "Engine fault"},
        503: {"model": ErrorResponse, "description": "Engine not running"},
    }


# One server-sent event as SSE-aware tools read it: `data` is a JSON chunk (the stream object's
# shape) or the final "[DONE]".
SSE_EVENT_SCHEMA = {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                   "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _ok_doc(model: type, what: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                  "description": f"{what}, or server-sent events (each `data` a JSON chunk, then "
                                 f"[DONE]) when stream is true"}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if not loc:
        return f"request body: {e.get('msg', 'invalid')}", None
    if e.get("type") == "extra_forbidden":  # extra="forbid": a field this server does not implement
        return f"{'.'.join(loc)}: this server does not support this field", loc[0]
    # The input value is deliberately left out: it may be prompt text, which is never echoed or logged.
    param = ".".join(loc)
    return f"{param}: {e.get('msg', 'invalid')}", loc[0]


def _narrow(prop: dict[str, Any], **schema: Any) -> None:
    """Replace a property's type information, keeping its title, description and default."""
    for key in ("type", "anyOf", "minimum", "maximum", "items"):
        prop.pop(key, None)
    prop.update(schema)


def _model_name_schema(name: str) -> dict[str, Any]:
    # The served name defaults to --model, which may be a directory: the public schema must not
    # show where the weights live, so a path-like name is documented as a plain string.
    if os.sep in name or "/" in name or os.path.exists(name):
        return {"type": "string"}
    return {"type": "string", "enum": [name]}


def _server_schema(schema: dict[str, Any], settings: ServerSettings, engine: EngineInfo) -> None:
    """What this server accepts beyond the pydantic types: its model name, token ids in its
    vocabulary, non-empty prompts, and the fields it does not support yet at their off
    values (the handlers answer those with a specific 400)."""
    comps = schema["components"]["schemas"]
    token = {"type": "integer", "minimum": 0, "maximum": engine.vocab_size - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        _narrow(props["model"], anyOf=[_model_name_schema(settings.served_model_name), {"type": "null"}])
        _narrow(props["stop"], anyOf=[{"type": "string", "minLength": 1},
                                      {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}])
        _narrow(props["stop_token_ids"], anyOf=[{"type": "array", "items": token}, {"type": "null"}])
        _narrow(props["logit_bias"], anyOf=[{"type": "object", "propertyNames": {"pattern": "^[0-9]{1,18}$"},
                                             "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                                      "maximum": MAX_LOGIT_BIAS}},
                                            {"type": "null"}])
        if not engine.uses_priority:
            _narrow(props["priority"], type="integer", enum=[0])
    comp = comps["CompletionRequest"]["properties"]
    _narrow(comp["prompt"], anyOf=[
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1}, "minItems": 1}])
    _narrow(comp["suffix"], type="null")
    chat = comps["ChatCompletionRequest"]["properties"]
    _narrow(chat["tools"], anyOf=[{"type": "array", "maxItems": 0}, {"type": "null"}])
    part = comps["TextContentPart"]
    part["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]
    for ops in schema["paths"].values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)  # invalid bodies get 400, as OpenAI answers


def _install_openapi(app: FastAPI, settings: ServerSettings, engine: EngineInfo) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _server_schema(schema, settings, engine)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """The app over an engine client: AsyncEngine (in this process) or EngineCoreClient (the
    engine-core process); the app's lifespan starts and stops it."""
    server = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start()
        log.info("serving %s (max_model_len=%d)", settings.served_model_name, engine.info.max_model_len)
        try:
            yield
        finally:
            await server.async_engine.stop()

    app = FastAPI(title="tokenslice", version=package_version(), lifespan=lifespan,
                  description="OpenAI-compatible server with token-level preemptive scheduling")
    app.state.server = server

    def _log_error(request: Request, status: int, message: str) -> None:
        server.metrics.reject(status)  # every error answer is counted, whatever raised it
        track: _Track | None = getattr(request.state, "track", None)
        if track is not None:
            track.status = status
            track.outcome = message
            track.log()
        else:
            log.info("%s %s status=%d (%s)", request.method, request.url.path, status, message)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _log_error(request, exc.status, exc.code or exc.type)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _log_error(request, 400, f"invalid {param or 'body'}")
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.metrics.reject(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), _error_type(exc.status_code),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        track: _Track | None = getattr(request.state, "track", None)
        rid = track.request_id if track else f"req-{uuid.uuid4().hex}"
        log.error("%s %s: unexpected error", rid, request.url.path, exc_info=exc)
        server.metrics.reject(500)
        return error_response(500, f"internal server error (request id {rid})", "server_error")

    v1 = APIRouter(prefix="/v1", responses=_error_docs())

    @v1.post("/completions", response_model=None, responses=_ok_doc(CompletionResponse, "A completion"))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @v1.post("/chat/completions", response_model=None,
             responses=_ok_doc(ChatCompletionResponse, "A chat completion"))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(body, request)

    @v1.post("/requests/{request_id}/priority", response_model=PriorityResponse,
             responses={404: {"model": ErrorResponse, "description": "No such live request"}})
    async def set_priority(request_id: str, body: PriorityUpdate) -> PriorityResponse:
        return await server.set_priority(request_id, body)

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @v1.get("/models/{model_id:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse, "description": "No such model"}})
    async def model(model_id: str) -> ModelCard:
        if model_id != settings.served_model_name:
            raise APIError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        return server.model_card()

    @v1.get("/state", responses={200: {"description": "The scheduler's state for the live view (/dashboard)"}})
    async def state() -> Response:
        try:
            return Response(encode_state(await server.state.get()), media_type="application/json")
        except (EngineDeadError, EngineFaultError) as e:
            raise APIError(503, str(e), "server_error") from None

    @v1.get("/state/stream", response_class=StreamingResponse,
            responses={200: {"description": "The state as server-sent events, a few a second"}})
    async def state_stream() -> StreamingResponse:
        return StreamingResponse(server.state.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    app.include_router(v1)
    add_dashboard(app, "live")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_error_docs())
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await server.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_error_docs())
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await server.detokenize(body)

    @app.get("/health", responses={503: {"description": "The engine loop is not running"}})
    async def health() -> Response:
        if server.async_engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    # vLLM's liveness probe (SageMaker calls it with POST): the same answer as /health.
    for method in ("GET", "POST"):  # one route per method: each needs its own OpenAPI operation id
        app.add_api_route("/ping", health, methods=[method], name="ping",
                          responses={503: {"description": "The engine loop is not running"}})

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _install_openapi(app, settings, engine.info)
    # Added last = outermost: the key is checked before any body is read.
    app.add_middleware(UnexpectedErrorMiddleware, handler=_unexpected)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, on_reject=server.metrics.reject)
    app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, on_reject=server.metrics.reject)
    return app

