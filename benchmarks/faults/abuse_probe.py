"""The outside probe's abusive clients against a real `tokenslice serve` (builtin:tiny, its own
process tree), each measured:

- flood: one completions request with 3,000 prompts, while a victim asks for 8 tokens: the
  flood's status and answer time, the victim's latency (alone first, as the baseline);
- leave: a client sends 1,000 prompts (`--max-prompts-per-request 1000`) and closes its connection
  once the engine holds some: seconds until the engine holds none, and the most requests
  waiting after it left;
- slow headers: N connections that send half their headers: seconds until the server has closed
  them all (`--request-read-timeout-s`, default 30);
- kill: `kill -9` of `serve`: engine-core socket folders left in its TMPDIR once its core is gone.

    PYTHONPATH=. .venv/bin/python benchmarks/faults/abuse_probe.py [--slow-connections 300]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/faultkit.py: serve as a process tree
from faultkit import alive, start_serve  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "builtin:tiny"
CAP_S = 120.0  # give up on any one wait after this


def live_requests(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    names = ("tokenslice:num_requests_running", "tokenslice:num_requests_waiting",
             "tokenslice:num_requests_preempted", "tokenslice:num_requests_admission_queue")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(names)))


def victim_latency(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=CAP_S,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0


def flood(url: str) -> dict[str, float | int]:
    alone = min(victim_latency(url) for _ in range(3))
    out: dict[str, float | int] = {"victim_alone_s": alone}

    def send() -> None:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=CAP_S,
                       json={"model": MODEL, "prompt": ["Once"] * 3000, "max_tokens": 16})
        out.update(flood_status=r.status_code, flood_answer_s=time.perf_counter() - t0)

    t = threading.Thread(target=send)
    t.start()
    out["victim_during_flood_s"] = victim_latency(url)
    t.join(CAP_S)
    return out


def leave(url: str, port: int) -> dict[str, float | int]:
    body = json.dumps({"model": MODEL, "prompt": ["Once upon a time"] * 1000, "max_tokens": 64,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=CAP_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + CAP_S
    while live_requests(url) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()
    left = time.perf_counter()
    peak = 0
    while (n := live_requests(url)) and time.monotonic() < deadline:
        peak = max(peak, n)
        time.sleep(0.01)
    return {"empty_after_leaving_s": time.perf_counter() - left, "peak_live_after_leaving": peak,
            "live_at_end": live_requests(url)}


def slow_headers(port: int, n: int) -> dict[str, float | int]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=CAP_S)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.perf_counter()
    closed = refused = 0
    for s in socks:  # b"": closed by the server; a 503: past the per-client bound
        s.settimeout(max(0.1, CAP_S - (time.perf_counter() - t0)))
        try:
            data = s.recv(1024)
            closed += data == b""
            refused += data.startswith(b"HTTP/1.1 503")
        except OSError:
            pass
        s.close()
    return {"connections": n, "closed_silently": closed, "refused_503": refused,
            "all_closed_after_s": time.perf_counter() - t0}


def kill_leftovers() -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp
        try:
            srv = start_serve()
        finally:
            if old is None:
                os.environ.pop("TMPDIR")
            else:
                os.environ["TMPDIR"] = old
        try:
            tree = [p for p in srv.tree() if p != srv.proc.pid]
            before = len([d for d in os.listdir(tmp) if d.startswith("tokenslice-core-")])
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(30)
            deadline = time.monotonic() + CAP_S
            while any(alive(p) for p in tree) and time.monotonic() < deadline:
                time.sleep(0.05)
            after = [d for d in os.listdir(tmp) if d.startswith("tokenslice-core-")]
            return {"socket_folders_before": before, "socket_folders_left": len(after),
                    "processes_left": sum(alive(p) for p in tree)}
        finally:
            srv.reap()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slow-connections", type=int, default=300)
    p.add_argument("--out", default=str(RESULTS / "abuse_probe.json"))
    a = p.parse_args()
    results: dict[str, object] = {"machine": platform.node(), "cpus": os.cpu_count(),
                                  "date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0]}
    srv = start_serve("--max-batch-size", "8")
    try:
        results["flood"] = flood(srv.url)
        print("flood", results["flood"], flush=True)
        results["slow_headers"] = slow_headers(srv.port, a.slow_connections)
        print("slow headers", results["slow_headers"], flush=True)
    finally:
        srv.reap()
    srv = start_serve("--max-batch-size", "8", "--max-prompts-per-request", "1000")
    try:
        results["leave"] = leave(srv.url, srv.port)
        print("leave", results["leave"], flush=True)
    finally:
        srv.reap()
    results["kill"] = kill_leftovers()
    print("kill -9", results["kill"], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
