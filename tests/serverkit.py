"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 on a free port, in a thread of
the test process (so tests can also inspect the engine), built exactly as `tokenslice serve`
builds it. Always stopped by the caller (use it as a context manager or call stop())."""
from __future__ import annotations

import dataclasses
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from tokenslice.cli import build_parser
from tokenslice.cli.serve import serve_app_from_args
from tokenslice.cli.serve_options import uvicorn_options
from tokenslice.engine.protocol import EngineInfo
from tokenslice.engine.engine import Engine
from tokenslice.server.serving import Server

STARTUP_TIMEOUT_S = 240.0  # the engine core process starts too: minutes on a busy 2-core machine
HTTP_TIMEOUT_S = 120.0  # a failure deadline for the helpers' own requests, not a performance check


@dataclass
class RunningServer:
    base_url: str
    app: Any
    uvicorn_server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket

    @property
    def server(self) -> Server:
        return self.app.state.server

    @property
    def engine(self) -> Engine:
        """The engine itself: only with --no-engine-process (else it lives in the core process)."""
        engine = getattr(self.server.async_engine, "engine", None)
        if engine is None:
            raise AttributeError("the engine runs in its own process; start the server with --no-engine-process")
        return engine

    @property
    def tokenizer(self) -> Any:
        return self.server.tokenizer

    @property
    def info(self) -> EngineInfo:
        return self.server.info

    @property
    def core_pid(self) -> int:
        return self.server.async_engine.pid

    def url(self, path: str) -> str:
        return self.base_url + path

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: `name{labels}` -> value, and `name` -> sum over labels."""
        text = httpx.get(self.url("/metrics"), timeout=HTTP_TIMEOUT_S).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = re.sub(r"\{.*\}", "", key)
            if name != key:
                out[name] = out.get(name, 0.0) + float(value)
        return out


def start_server(*flags: str) -> RunningServer:
    """Start `tokenslice serve --model builtin:tiny <flags>` in-process on a free port, with the
    uvicorn settings `serve` gives those flags (root path, connection limits)."""
    args = build_parser().parse_args(["--log-level", "INFO", "serve", "--model", "builtin:tiny", "--no-compile", *flags])
    options = {k: v for k, v in uvicorn_options(args).items() if k not in ("host", "port", "log_level")}
    return serve_app(serve_app_from_args(args), **options)


def serve_app(app: Any, startup_timeout_s: float = STARTUP_TIMEOUT_S, **uvicorn_settings: Any) -> RunningServer:
    """Serve an ASGI app (the API server, `tokenslice view`'s) with uvicorn in a thread, on a free
    port; `uvicorn_settings`: more of uvicorn.Config's keywords."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, **uvicorn_settings)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread, sock)


def wait_idle(srv: RunningServer, timeout: float = 60.0) -> dict[str, float]:
    """Wait until the engine has no live request (a failure deadline, not a performance check)."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        idle = (m["tokenslice:num_requests_running"] == 0 and m["tokenslice:num_requests_waiting"] == 0
                and m["tokenslice:num_requests_preempted"] == 0 and m["tokenslice:num_requests_admission_queue"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def until(cond: Any, timeout: float = 60.0) -> None:
    """Wait until `cond()` holds (a failure deadline, not a performance check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def wait_healthy(proc: Any, base: str, timeout_s: float) -> None:
    """Wait until a `tokenslice serve` child answers /health; fail with its output if it exits
    first, or after `timeout_s` (a failure deadline for start-up, not a performance check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def stop_child(proc: Any) -> str:
    """SIGTERM a `tokenslice serve` child, kill it if it has not exited after 30 s; its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


# ---- the server behind a path prefix ------------------------------------------------------------
# How a client reaches a server: directly ("plain"); a server started with --root-path that gets
# the paths without the prefix, as a prefix-stripping proxy forwards them ("root-path"); and
# through such a proxy, the client sending the prefix ("proxy").
REACH_MODES = ("plain", "root-path", "proxy")
ROOT_PATH = "/api"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}


class PrefixProxy:
    """A reverse proxy on 127.0.0.1 that takes requests under `prefix`, strips it and forwards them
    to `upstream` as they are (duplicate headers too), streaming the answer back; 404 for paths
    outside the prefix. Stopped by the caller."""

    def __init__(self, prefix: str, upstream: str) -> None:
        import http.client
        import http.server
        from urllib.parse import urlsplit

        target = urlsplit(upstream)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def forward(self) -> None:
                if self.path != prefix and not self.path.startswith((prefix + "/", prefix + "?")):
                    self.send_error(404)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=HTTP_TIMEOUT_S)
                try:
                    conn.putrequest(self.command, self.path[len(prefix):] or "/", skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in HOP_BY_HOP:
                            conn.putheader(name, value)
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    self.send_response_only(resp.status, resp.reason)
                    for name, value in resp.getheaders():
                        if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                            self.send_header(name, value)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    while chunk := resp.read1(65536):  # as it arrives: streamed answers stay streamed
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client left: closing the upstream connection tells the server
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = forward

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="prefix-proxy", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(30)


@contextmanager
def server_reached(mode: str, *flags: str) -> Iterator[RunningServer]:
    """start_server(*flags), reached as `mode` (REACH_MODES) says: the yielded server's base_url
    is where a client of that mode sends its requests."""
    if mode == "plain":
        with start_server(*flags) as srv:
            yield srv
        return
    with start_server(*flags, "--root-path", ROOT_PATH) as srv:
        if mode == "root-path":
            yield srv
            return
        proxy = PrefixProxy(ROOT_PATH, srv.base_url)
        try:
            yield dataclasses.replace(srv, base_url=proxy.url + ROOT_PATH)
        finally:
            proxy.stop()
