"""FastAPI app: OpenAI-compatible routes over an engine client (docs/DESIGN.md, Data flow).

Routes: POST /v1/completions (server/completions.py), POST /v1/chat/completions (server/chat.py),
POST /v1/requests/{id}/priority, GET /v1/models[/{id}], GET /v1/state[/stream] (the live view's
data, server/state.py), POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /health, GET|POST /ping,
GET /version, GET /metrics (server/routes.py), and the live view's page GET /dashboard
(server/dashboard.py). Every error body is OpenAI's `{"error": {"message", "type", "param",
"code"}}` (server/errors.py).
When an API key is set, every path needs `Authorization: Bearer KEY` but /health, /ping, /version,
/metrics, /dashboard (a page without data) and the API's description (/openapi.json, /docs,
/redoc), so that probes and scrapers need no secret; the check fails closed, on the path the
router routes (`--root-path` removed; server/middleware.py). --metrics-require-key closes
/metrics to all but admin keys. With --api-keys each key stands for a tenant (server/identity.py).

One log line per generation request (id, tokens, finish reason, latency); prompt and output
text are never logged.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenslice.engine.protocol import EngineClient
from tokenslice.server.chat import add_chat_route
from tokenslice.server.completions import add_completion_route
from tokenslice.server.dashboard import add_dashboard
from tokenslice.server.errors import add_error_handlers
from tokenslice.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, UnexpectedErrorMiddleware
from tokenslice.server.openapi import error_docs, install_openapi
from tokenslice.server.routes import add_utility_routes, add_v1_routes, package_version
from tokenslice.server.serving import Server
from tokenslice.server.settings import ServerSettings

log = logging.getLogger("tokenslice.server")


def create_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """The app over an engine client: AsyncEngine (in this process) or EngineCoreClient (the
    engine-core process); the app's lifespan starts and stops it. `app.state.server` is its
    `Server`."""
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
    unexpected = add_error_handlers(app, server.metrics)

    v1 = APIRouter(prefix="/v1", responses=error_docs())
    add_completion_route(v1, server)
    add_chat_route(v1, server)
    add_v1_routes(v1, server)
    app.include_router(v1)
    add_dashboard(app, "live")
    add_utility_routes(app, server)

    install_openapi(app, settings, engine.info)
    # Added last = outermost: the key is checked before any body is read.
    app.add_middleware(UnexpectedErrorMiddleware, handler=unexpected)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, on_reject=server.metrics.reject,
                       read_timeout_s=settings.request_read_timeout_s)
    app.add_middleware(APIKeyMiddleware, keyring=server.keyring, on_reject=server.metrics.reject,
                       metrics_require_key=settings.metrics_require_key)
    if settings.allowed_origins:  # outermost: a browser's preflight needs no key (--allowed-origins)
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)
    return app
