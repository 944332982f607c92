"""Helpers for the fault tests and benchmarks/faults/kill_loop.py: `tokenslice serve` as a real
process in a session of its own, the processes it started (engine core, rank workers, Ray's
processes and actors), one of them killed with SIGKILL, and what is left afterwards.

A process counts as gone once it has exited (a zombie whose parent has not reaped it yet
counts as gone). The caller always calls `Serve.reap()`, which kills whatever is left."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:tiny"
STARTUP_TIMEOUT_S = 240.0  # failure deadline: -tp 2 and Ray start slowly on a busy 2-core machine
# What is killed: the engine core, one -tp 2 rank worker, one Ray actor (private cluster), or the
# server itself (over -tp 2 workers, or over the private Ray cluster).
KINDS = ("core", "worker", "ray_actor", "server", "ray_server")
FLAGS = {"core": (), "worker": ("-tp", "2"), "ray_actor": ("--executor", "ray", "-tp", "2"), "server": ("-tp", "2"),
         "ray_server": ("--executor", "ray", "-tp", "2")}


def kills_server(kind: str) -> bool:
    return kind in ("server", "ray_server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running (not exited, not a zombie)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pid: int) -> list[int]:
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return sorted(set(out))


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return sorted(set(out))


def session(sid: int) -> list[int]:
    """Every live process of session `sid` (what a process that left its parent's tree still shares)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and int(st[4]) == sid and st[0] not in ("Z", "X"):
                out.append(int(entry))
    return sorted(out)


@dataclass
class Serve:
    """A `tokenslice serve` process in its own session, its output collected by a thread."""

    proc: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def core_pid(self) -> int:
        m = re.search(r"engine core running in process (\d+)", self.output)
        assert m, self.output[-3000:]
        return int(m.group(1))

    def tree(self) -> list[int]:
        """Every live process this server started, directly or not (itself left out)."""
        return sorted((set(descendants(self.proc.pid)) | set(session(self.proc.pid))) - {self.proc.pid})

    def reap(self) -> list[int]:
        """Kill the server and every process of its session that is still running; returns those
        other than the server."""
        left = [p for p in self.tree() if alive(p)]
        for pid in [self.proc.pid, *left]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        return left


def start_serve(*flags: str, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Serve:
    """`tokenslice serve --model builtin:tiny --no-compile FLAGS` on a free port; returns once
    /health answers 200. The caller reaps it."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", "--model", MODEL, "--no-compile", "--port", str(port),
           *flags]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    srv = Serve(proc, port)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            srv.lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start (exit {proc.poll()}):\n{srv.output[-3000:]}")
            try:
                if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                    return srv
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    except BaseException:
        srv.reap()
        raise


def victim(srv: Serve, kind: str, index: int = 0) -> int:
    """The process of `kind` to kill: the server, its engine core, or rank worker / Ray actor
    number `index % 2` (in start order)."""
    if kills_server(kind):
        return srv.proc.pid
    core = srv.core_pid()
    if kind == "core":
        return core
    if kind == "worker":
        ranks = [p for p in children(core) if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
    elif kind == "ray_actor":
        ranks = [p for p in descendants(core) if cmdline(p).startswith("ray::RankActor")]
    else:
        raise ValueError(kind)
    assert len(ranks) == 2, (kind, [(p, cmdline(p)) for p in descendants(core)])
    return ranks[index % 2]


def stream_in_flight(srv: Serve, timeout_s: float = 120.0) -> threading.Thread:
    """A long streaming completion (as long as builtin:tiny's context allows); returns once its
    first token arrived (the thread ends when the stream does)."""
    first = threading.Event()
    status: list[int] = []

    def run() -> None:
        body = {"model": MODEL, "prompt": "in flight", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=timeout_s) as r:
                status.append(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first.set()
        except httpx.HTTPError:
            pass
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert first.wait(timeout_s) and status == [200], f"no first token (status {status})"
    return t


@dataclass
class KillOutcome:
    kind: str
    in_flight: bool
    victim: int
    exit_code: int | None  # the server's; None: still running at the cap
    exit_s: float | None  # kill -> server exit (the kill itself for kind "server")
    gone_s: float | None  # kill -> every process the server started gone; None: not within the cap
    orphans: list[str]  # processes still running `orphan_after_s` after the server's exit


def kill_and_watch(srv: Serve, kind: str, index: int = 0, in_flight: bool = False, cap_s: float = 30.0,
                   orphan_after_s: float = 2.0) -> KillOutcome:
    """SIGKILL one process of `kind`; wait (up to cap_s) for the server to exit and for every
    process it started to be gone. Reap the server afterwards."""
    if in_flight:
        stream_in_flight(srv)
    pid = victim(srv, kind, index)
    tree = [p for p in srv.tree() if p != pid]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    exit_s = gone_s = None
    orphans: list[str] = []
    checked = False
    while time.monotonic() - t0 < cap_s:
        now = time.monotonic() - t0
        if exit_s is None and srv.proc.poll() is not None:
            exit_s = now
        running = [p for p in tree if alive(p)]
        if exit_s is not None and not checked and now >= exit_s + orphan_after_s:
            orphans = [f"{p} {cmdline(p)[:80]}" for p in running]
            checked = True
        if exit_s is not None and not running:
            gone_s = now
            break
        time.sleep(0.02)
    if exit_s is not None and not checked:
        orphans = [f"{p} {cmdline(p)[:80]}" for p in tree if alive(p)]
    return KillOutcome(kind, in_flight, pid, srv.proc.poll(), exit_s, gone_s, orphans)


def listeners(pids: list[int]) -> list[tuple[str, int, str]]:
    """(local address, pid, process name) of every TCP listener and bound UDP socket of `pids`,
    from `ss`."""
    out = subprocess.run(["ss", "-Hlntup"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[4]
        for name, pid in re.findall(r'\("([^"]*)",pid=(\d+),', line):
            if int(pid) in pids:
                found.append((local, int(pid), name))
    return found


def is_loopback(address: str) -> bool:
    """ss's local address (HOST:PORT) is on the loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")
