"""The routes besides generation: a live request's priority, the models, the scheduler's state
(the live view's data, server/state.py), /tokenize, /detokenize and /tokenizer_info, and the open
probes (/health, /ping, /version, /metrics)."""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from tokenslice.engine.protocol import EngineDeadError, EngineFaultError
from tokenslice.request import InvalidRequestError
from tokenslice.server.errors import APIError, engine_fault, engine_unavailable
from tokenslice.server.identity import Tenant, tenant_of
from tokenslice.server.openapi import error_docs
from tokenslice.server.protocol import DetokenizeRequest, PriorityUpdate, TokenizeRequest
from tokenslice.server.responses import (DetokenizeResponse, ErrorResponse, ModelCard, ModelList, PriorityResponse,
                                         TokenizerInfoResponse, TokenizeResponse, VersionResponse)
from tokenslice.server.serving import Server
from tokenslice.server.state import encode as encode_state
from tokenslice.server.state import visible_state
from tokenslice.server.track import log_text

log = logging.getLogger("tokenslice.server")


def package_version() -> str:
    try:
        return importlib.metadata.version("tokenslice")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def add_v1_routes(v1: APIRouter, server: Server) -> None:
    """/v1/requests/{id}/priority, /v1/models[/{id}] and /v1/state[/stream]."""

    @v1.post("/requests/{request_id}/priority", response_model=PriorityResponse,
             responses={404: {"model": ErrorResponse, "description": "No such live request"}})
    async def set_priority(request_id: str, body: PriorityUpdate, request: Request) -> PriorityResponse:
        return await set_request_priority(server, request_id, body, tenant_of(request.state))

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card(server, name) for name in server.settings.model_names])

    @v1.get("/models/{model_id:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse, "description": "No such model"}})
    async def model(model_id: str) -> ModelCard:
        server.check_model(model_id)
        return model_card(server, model_id)

    @v1.get("/state", responses={200: {"description": "The scheduler's state for the live view (/dashboard)"}})
    async def state(request: Request) -> Response:
        try:
            view = visible_state(await server.state.get(), tenant_of(request.state))
            return Response(encode_state(view), media_type="application/json")
        except (EngineDeadError, EngineFaultError) as e:
            raise APIError(503, str(e), "server_error") from None

    @v1.get("/state/stream", response_class=StreamingResponse,
            responses={200: {"description": "The state as server-sent events, a few a second"}})
    async def state_stream(request: Request) -> StreamingResponse:
        return StreamingResponse(server.state.stream(tenant_of(request.state)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def add_utility_routes(app: FastAPI, server: Server) -> None:
    """/tokenize and /detokenize (behind the API key), and the open probes."""

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_docs())
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize_request(server, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_docs())
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize_request(server, body)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=error_docs())
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenizer_config(server))

    @app.get("/health", responses={503: {"description": "The engine loop is not running"}})
    async def health() -> Response:
        if server.async_engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    # vLLM's liveness probe (SageMaker calls it with POST): the same answer as /health.
    ping_methods = ("GET", "POST")
    for method in ping_methods:  # one route per method: each needs its own OpenAPI operation id
        app.add_api_route("/ping", health, methods=[method], name="ping",
                          responses={503: {"description": "The engine loop is not running"}})
    # Any other method: the routes above would each answer 405 naming only their own method.
    app.add_route("/ping", MethodNotAllowed(ping_methods), include_in_schema=False)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class MethodNotAllowed:
    """An ASGI endpoint that answers every request 405 allowing `methods` (an ASGI app, not a
    function, so that its route matches every method)."""

    def __init__(self, methods: tuple[str, ...]) -> None:
        self.allow = ", ".join(methods)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise StarletteHTTPException(405, headers={"Allow": self.allow})


async def set_request_priority(server: Server, request_id: str, body: PriorityUpdate,
                               tenant: Tenant) -> PriorityResponse:
    """A live request's new priority, applied before the next step (FastSwitch): clamped into
    the caller's range; a tenant may change only its own requests, an admin any."""
    priority = server.priority_for(tenant, body.priority)
    try:
        live = tenant.admin or server.tenants.owns(tenant, request_id)
        live = live and await server.async_engine.set_priority(request_id, priority)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    except EngineDeadError:
        raise engine_unavailable(server.settings.retry_after_s) from None
    except EngineFaultError as e:
        raise engine_fault(request_id, e) from None
    if not live:
        raise APIError(404, f"no live request {request_id!r}: it finished, was aborted, never existed or is "
                            "another API key's", code="request_not_found")
    log.info("%s priority=%d", log_text(request_id), priority)
    return PriorityResponse(id=request_id, priority=priority)


def model_card(server: Server, name: str) -> ModelCard:
    """One served name as vLLM lists it: `root` is the model behind it."""
    return ModelCard(id=name, root=server.settings.model_root or name, max_model_len=server.info.max_model_len)


def tokenizer_config(server: Server) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init settings without file paths, its class, and the
    chat template in use (lm-eval reads it to pick the tokenizer)."""
    tok = server.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    config = {k: _json_value(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    config["tokenizer_class"] = type(tok).__name__
    template = server.prompts.template
    if template:
        config["chat_template"] = template
    return config


def _json_value(value: Any) -> Any:
    """Settings as JSON: special tokens (AddedToken) by their text, other objects as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


async def tokenize_request(server: Server, body: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: what the completion and chat routes would feed the engine."""
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ids = await run_in_threadpool(server.prompts.render_chat, body.messages, body.add_generation_prompt,
                                      bool(body.add_special_tokens))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await run_in_threadpool(server.prompts.tokenize_prompt, body.prompt, special)
    return TokenizeResponse(count=len(ids), max_model_len=server.info.max_model_len, tokens=ids)


async def detokenize_request(server: Server, body: DetokenizeRequest) -> DetokenizeResponse:
    server.check_model(body.model)
    tok = server.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    bad = next((t for t in body.tokens if not 0 <= t < server.info.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{server.info.vocab_size - 1})",
                       param="tokens")
    return DetokenizeResponse(prompt=await run_in_threadpool(tok.decode, body.tokens))
