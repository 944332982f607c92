"""`kill -9` of one data-parallel replica under load (issue: 10/10 runs lose no request that had
not started and no stream of the other replica).

Each run: `tokenslice serve --model builtin:tiny --no-compile --data-parallel-size 2 --router
round-robin` (half the requests on each replica) in its own process tree; 40 streamed completions (64 tokens each, ignore_eos) sent at
once; once 10 streams have their first token, replica 1 (its pid from /v1/state) gets SIGKILL.
A request may only fail if its stream had started (it ran on the killed replica: its KV is gone);
one that fails before its first token was lost (it should have been re-routed), and one that
fails after its first token on the surviving replica cannot be told apart from the client, so
the check is: every failure had started, and the requests that did not fail are all complete.
Afterwards a fresh request must succeed (the server keeps serving), and the server must still be
running.

    PYTHONPATH=. .venv/bin/python benchmarks/faults/data_parallel_kill.py [--runs 10]

Results: benchmarks/faults/results/data_parallel_kill.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/faultkit.py: serve as a process tree
from faultkit import start_serve  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REQUESTS = 40
TOKENS = 64
KILL_AFTER_STARTED = 10
CAP_S = 300.0


def stream(url: str, started: threading.Semaphore) -> dict[str, Any]:
    """A streamed completion: chunks received (one per token) and how it ended."""
    tokens, error, finish = 0, None, None
    body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=CAP_S) as r:
            if r.status_code != 200:
                return {"tokens": 0, "error": f"HTTP {r.status_code}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                choice = chunk["choices"][0]
                finish = choice.get("finish_reason") or finish
                if choice.get("finish_reason") is None:
                    tokens += 1
                    if tokens == 1:
                        started.release()
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"tokens": tokens, "error": error, "finish": finish}


def one_run(i: int) -> dict[str, Any]:
    srv = start_serve("--data-parallel-size", "2", "--router", "round-robin", "--kv-cache-blocks", "256")
    try:
        victim = httpx.get(srv.url + "/v1/state", timeout=30).json()["data_parallel"]["replicas"][1]["pid"]
        started = threading.Semaphore(0)
        with ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(stream, srv.url, started) for _ in range(REQUESTS)]
            for _ in range(KILL_AFTER_STARTED):
                if not started.acquire(timeout=CAP_S):
                    raise RuntimeError("streams did not start")
            os.kill(victim, signal.SIGKILL)
            results = [f.result(timeout=CAP_S) for f in futures]
        after = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": "The dog", "max_tokens": 8, "temperature": 0}).status_code
        state = httpx.get(srv.url + "/v1/state", timeout=30).json()["data_parallel"]
        failed = [r for r in results if r["error"]]
        ok = [r for r in results if not r["error"]]
        out = {"run": i, "failed_started": sum(r["tokens"] > 0 for r in failed),
               "failed_unstarted": sum(r["tokens"] == 0 for r in failed),
               "complete": sum(r["finish"] == "length" for r in ok),
               "incomplete_ok": sum(r["finish"] != "length" for r in ok),
               "rerouted": state["rerouted"], "after_status": after, "server_running": srv.proc.poll() is None,
               "errors": sorted({r["error"] for r in failed})[:3]}
        out["pass"] = (out["failed_unstarted"] == 0 and out["incomplete_ok"] == 0 and after == 200
                       and out["server_running"])
        return out
    finally:
        srv.reap()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    runs = []
    for i in range(a.runs):
        t = time.perf_counter()
        runs.append(one_run(i))
        print(f"run {i}: {runs[-1]} ({time.perf_counter() - t:.1f} s)", flush=True)
    passed = sum(r["pass"] for r in runs)
    print(f"\n{passed}/{len(runs)} runs pass: no unstarted request lost, every other stream complete, "
          f"the server serving after")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data_parallel_kill.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "runs": runs, "passed": passed}, indent=1))


if __name__ == "__main__":
    main()
