"""OpenAI's error object and the app's error handlers: every error answer is
`{"error": {"message", "type", "param", "code"}}`, counted in the metrics and logged in one line."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenslice.engine.protocol import EngineDeadError, RequestFailedError
from tokenslice.server.metrics import ServerMetrics
from tokenslice.server.responses import ErrorInfo, ErrorResponse
from tokenslice.server.track import Track, log_text

log = logging.getLogger("tokenslice.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


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


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_type(status: int) -> str:
    return _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def engine_fault(request_id: str, e: BaseException) -> APIError:
    """The 500 for a request the engine failed; logged here."""
    if isinstance(e, RequestFailedError):  # the request's own doing (its grammar): the client reads why
        log.info("%s ended in the engine: %s", request_id, e)
        return APIError(400, f"{e} (request id {request_id})")
    log.error("%s failed in the engine: %s", request_id, e)
    if isinstance(e, EngineDeadError):  # the server is done for: say why (e.g. which worker died), in one line
        why = (str(e).splitlines() or [type(e).__name__])[0]
        return APIError(500, f"the engine stopped: {why} (request id {request_id})", type="server_error",
                        code="engine_error")
    return APIError(500, f"internal engine error (request id {request_id})", type="server_error",
                    code="engine_error")


def engine_unavailable(retry_after_s: int) -> APIError:
    return APIError(503, "the engine is not running", type="server_error", code="engine_unavailable",
                    headers={"Retry-After": str(retry_after_s)})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the 400 for a body that fails validation."""
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


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """Answer every error with the error object; returns the handler of unexpected exceptions
    (middleware.UnexpectedErrorMiddleware calls it)."""

    def log_error(request: Request, status: int, message: str) -> None:
        metrics.reject(status)  # every error answer is counted, whatever raised it
        track: Track | None = getattr(request.state, "track", None)
        if track is not None:
            track.status = status
            track.outcome = message
            track.log()
        else:
            log.info("%s %s status=%d (%s)", log_text(request.method), log_text(request.url.path), status,
                     log_text(message))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        log_error(request, exc.status, exc.code or exc.type)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        log_error(request, 400, f"invalid {param or 'body'}")
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.reject(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), error_type(exc.status_code),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        track: Track | None = getattr(request.state, "track", None)
        rid = track.request_id if track else f"req-{uuid.uuid4().hex}"
        log.error("%s %s: unexpected error", rid, log_text(request.url.path), exc_info=exc)
        metrics.reject(500)
        return error_response(500, f"internal server error (request id {rid})", "server_error")

    return unexpected
