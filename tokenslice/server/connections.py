"""Slow and greedy clients, below the ASGI app: a deadline for each request's headers and a bound
on one address's open connections (`serve --request-read-timeout-s`, `--max-connections-per-client`).

uvicorn has neither: a client that sends half its headers keeps its connection, and a descriptor,
for as long as it likes (its keep-alive timer runs only between answers), and one address may open
as many connections as the process has descriptors. The body's deadline is the ASGI side's
(server/middleware.py BodyLimitMiddleware), since the app reads the body.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tokenslice.server.responses import ErrorInfo, ErrorResponse


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float  # from connecting (or from the previous answer) to a request's last header
    max_per_client: int  # open connections per client address; 0: no bound


class ClientConnections:
    """Open connections per client address, and whether one more may open."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}

    def acquire(self, host: str) -> bool:
        n = self.open.get(host, 0)
        if self.limit and n >= self.limit:
            return False
        self.open[host] = n + 1
        return True

    def release(self, host: str) -> None:
        n = self.open.get(host, 0) - 1
        if n > 0:
            self.open[host] = n
        else:
            self.open.pop(host, None)


def too_many_connections_answer(limit: int) -> bytes:
    """The 503 a connection past the bound gets before it is closed (it has sent nothing yet)."""
    body = ErrorResponse(error=ErrorInfo(
        message=f"too many open connections from this address (the limit is {limit}); reuse or close some",
        type="server_error", code="too_many_connections")).model_dump_json().encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_http_protocol(limits: ConnectionLimits, base: type[asyncio.Protocol] = AutoHTTPProtocol
                          ) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (h11 or httptools; `uvicorn.Config(http=...)`) with the limits:
    one class per server, holding that server's connection counts."""
    counts = ClientConnections(limits.max_per_client)
    refusal = too_many_connections_answer(limits.max_per_client)

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        # Both of uvicorn's HTTP/1.1 protocols start a new `cycle` when a request's headers are
        # complete and call on_response_complete after each answer: the deadline runs between the two.
        _host: str | None = None
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: Any = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if host is not None and not counts.acquire(host):
                transport.write(refusal)  # type: ignore[attr-defined]
                transport.close()
                return
            self._host = host
            self._timed_cycle = self.cycle
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._note_new_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._note_new_request() and not self.transport.is_closing():
                self._arm()  # the next request's headers get their own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._host is not None:
                counts.release(self._host)
                self._host = None
            super().connection_lost(exc)

        def _note_new_request(self) -> bool:
            """Whether a request's headers arrived since the deadline was set (it is then lifted)."""
            if self.cycle is self._timed_cycle:
                return False
            self._timed_cycle = self.cycle
            self._disarm()
            return True

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol


__all__ = ["ConnectionLimits", "ClientConnections", "guarded_http_protocol"]
