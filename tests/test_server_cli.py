"""`tokenslice serve` as a real subprocess: binds 127.0.0.1, answers, logs one line per request
without the prompt text, and stops on SIGTERM (sent to its own PID only)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from serverkit import stop_child, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
SECRET = "MARMALADE-PROMPT-TEXT"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subcommand() -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", "--model", "builtin:tiny", "--port", str(port),
           "--kv-cache-blocks", "16", "--served-model-name", "tiny", "--api-key", "k", "--no-compile"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, 90)
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt=SECRET, max_tokens=3)
        assert r.usage.prompt_tokens == len(SECRET.encode())  # byte-level tokenizer
        assert httpx.get(base + "/v1/models").status_code == 401
        # Bound to loopback only: the port is free on every other local address.
        with socket.socket() as s:
            s.settimeout(1)
            other = socket.gethostbyname(socket.gethostname())
            if not other.startswith("127."):
                assert s.connect_ex((other, port)) != 0
    finally:
        out = stop_child(proc)
    lines = [line for line in out.splitlines() if r.id in line]
    assert len(lines) == 1 and "prompt_tokens=" in lines[0] and "latency=" in lines[0], out[-2000:]
    assert SECRET not in out
    # uvicorn shuts down cleanly, then re-raises the signal it caught, as a default handler would.
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]
    assert "Application shutdown complete" in out
