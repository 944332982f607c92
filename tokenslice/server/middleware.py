"""The app's ASGI middlewares: the API key (and its tenant), the body limit, and the 500 for
unexpected errors.

Pure ASGI: BaseHTTPMiddleware would break the handlers' disconnect detection."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette._utils import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenslice.server.errors import error_response
from tokenslice.server.identity import Keyring

DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # of an oversized body, read and dropped before the 413
# With keys set, these routes stay open (probes, scrapers, the data-free page and the API's
# description); every other path, unknown ones included, needs a key: the check fails closed.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/dashboard", "/openapi.json", "/docs",
                          "/docs/oauth2-redirect", "/redoc"})
PUBLIC_PREFIXES = ("/dashboard/static/",)  # the page's assets (a StaticFiles mount)


class APIKeyMiddleware:
    """With keys set, 401 without `Authorization: Bearer <key>` of a known key on every path but
    PUBLIC_PATHS (and /metrics, unless `metrics_require_key`), decided on the routed path; 400 for
    more than one Authorization header (a proxy that reads the first and this server would
    disagree on who is asking). The scheme is case-insensitive (RFC 7235 §2.1). The key's
    tenant goes on the request's state (`tenant`, server/identity.py); /metrics then needs an
    admin key (403 for others)."""

    def __init__(self, app: ASGIApp, keyring: Keyring, on_reject: Callable[[int], None],
                 metrics_require_key: bool = False) -> None:
        self.app = app
        self.keyring = keyring
        self.on_reject = on_reject
        self.metrics_require_key = metrics_require_key

    def is_public(self, path: str) -> bool:
        if path == "/metrics":
            return not self.metrics_require_key
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keyring.required or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # The router's own path: uvicorn puts --root-path in front of the path it received and
        # routing removes it again, so the check must look at what the router will route.
        path = get_route_path(scope)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:
            self.on_reject(400)
            resp = error_response(400, "more than one Authorization header; send exactly one",
                                  param="Authorization", code="duplicate_authorization")
            await resp(scope, receive, send)
            return
        if self.is_public(path):
            await self.app(scope, receive, send)
            return
        scheme, _, key = (given[0] if given else b"").partition(b" ")
        tenant = self.keyring.identify(key.strip()) if scheme.lower() == b"bearer" else None
        if tenant is None:
            self.on_reject(401)
            resp = error_response(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif path == "/metrics" and not tenant.admin:
            self.on_reject(403)
            resp = error_response(403, "/metrics needs an admin API key", code="permission_denied")
        else:
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no HTTP answer on a websocket: refuse the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        await resp(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over the limit, 408 (and the connection closed) for a body not all
    sent within `read_timeout_s` of its headers. The body is read here (it would be buffered by
    the JSON parser anyway) and replayed to the app; the original `receive` then stays
    available so handlers can notice a disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int], None],
                 read_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.read_timeout_s = read_timeout_s

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
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client left before sending its body: nobody to answer
                    chunks.append(msg.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        break
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            self.on_reject(408)
            resp = error_response(408, f"the request body was not received within {self.read_timeout_s:g} s",
                                  code="request_timeout", headers={"Connection": "close"})
            await resp(scope, receive, send)
            return
        if size > self.max_bytes:
            await self._too_large(scope, receive, send, more_body=msg.get("more_body", False))
            return
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

    def __init__(self, app: ASGIApp, handler: Callable[[Request, Exception], Awaitable[JSONResponse]]) -> None:
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
