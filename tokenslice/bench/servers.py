"""The `tokenslice serve` child processes that `bench --model` and `twin` start: one per policy,
on a loopback port (a free one, or the one given), stopped by their own PID. No torch here."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


@dataclass
class ServerSpec:
    """How `bench --model` starts a server per policy: `tokenslice serve` in a child process."""

    model: str
    args: list[str] = field(default_factory=list)  # further `serve` flags (batch size, KV blocks, profile, ...)
    threads: int | None = None  # torch threads in the server (OMP_NUM_THREADS); None: torch's default
    api_key: str | None = None
    # The first server's port; the k-th server of a bench (its k-th policy) gets port + k.
    # None: a free port each.
    port: int | None = None


def served_name(model: str) -> str:
    """The name a bench server answers to first: a model directory's own name (not its full path);
    other models as `serve` names them."""
    path = Path(model)
    return path.name if path.is_dir() and path.name else model


def serve_command(spec: ServerSpec, policy: str, port: int, slo_normalized_latency: float | None = None) -> list[str]:
    """The `tokenslice serve` command line of one bench server."""
    cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "serve", "--model", spec.model,
           "--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    if slo_normalized_latency is not None and "--slo-normalized-latency" not in spec.args:
        cmd += ["--slo-normalized-latency", repr(slo_normalized_latency)]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    name = served_name(spec.model)
    if "--served-model-name" not in spec.args and name != spec.model:
        cmd += ["--served-model-name", name, spec.model]
    return cmd + list(spec.args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: the kernel sends it SIGTERM when the bench process dies,
    # however it dies (even SIGKILL), so no server is left running without its client.
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """`tokenslice serve` as a child process on a loopback port; stopped with SIGTERM to its own
    PID (SIGKILL only if it does not exit). Its log goes to a temporary file, shown on failure.
    It answers to the model directory's name, and to the full --model value as well (clients that
    send the path keep working)."""

    def __init__(self, spec: ServerSpec, policy: str, slo_normalized_latency: float | None = None,
                 port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = serve_command(spec, policy, self.port, slo_normalized_latency)
        env = dict(os.environ)
        if spec.threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"tokenslice-bench-{policy}-", suffix=".log")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up in {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-chars:]

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM a child still running, SIGKILL it if it has not exited within `timeout_s`; reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_server(spec: ServerSpec, policy: str, slo_normalized_latency: float | None = None,
                   index: int = 0) -> Iterator[str]:
    """A started server's base URL; the server is stopped however the block ends. `index`: the
    server's place among the bench's (its port is spec.port + index when a port is given)."""
    server = ServerProcess(spec, policy, slo_normalized_latency, None if spec.port is None else spec.port + index)
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


__all__ = ["ServerSpec", "ServerProcess", "running_server", "serve_command", "served_name", "free_port",
           "STARTUP_TIMEOUT_S", "STOP_TIMEOUT_S", "stop_process"]
