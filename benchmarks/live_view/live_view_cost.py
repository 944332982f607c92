"""What the live view (/v1/state, /v1/state/stream) costs the engine.

The engine takes at most one snapshot every 250 ms (server/state.py, MIN_INTERVAL_S) however
many viewers read it, so its cost is the time of one `Engine.state()` four times a second.

Setup, fixed before any result was seen:
  * in-process: ../shared/models/stories260k, fp32, one PyTorch thread, max batch 16, 4096 KV
    blocks, fcfs; N live requests (prompts of 32 token ids, 1000-token outputs with ignore_eos),
    20 warm-up steps, then the mean of 200 steps and of 200 `Engine.state()` calls, for N = 16,
    256 and 1000. Cost = 4 x state time per second of engine time, and state time / step time;
  * over HTTP: `tokenslice serve` (engine core in its own process, one thread), 32 streamed
    requests of 400 tokens kept in flight; engine steps per second (`num_steps` from the
    engine's stats) over 5 s windows with 0, 1 and 10 `/v1/state/stream` viewers, interleaved,
    `--rounds` times. On a shared 2-core machine the HTTP numbers are noisy; the in-process
    numbers are the bound.

    .venv/bin/python benchmarks/live_view/live_view_cost.py --out benchmarks/live_view/results/live_view_cost.json

Results (2-core shared development machine, benchmarks/live_view/results/live_view_cost.json): one
snapshot takes 0.04 / 0.47 / 1.87 ms with 16 / 256 / 1,000 live requests (steps of 1.35 ms),
so 0.01% / 0.19% / 0.75% of the engine's time at 4 Hz, for one viewer or ten alike. Over HTTP
the medians of 4 rounds were 357 / 316 / 391 steps/s with 0 / 1 / 10 viewers: noise of the
shared cores (±12%, no trend with viewers), far above the cost measured in-process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from tokenslice import LLM, SamplingParams
from tokenslice.bench.sweep import ServerSpec, running_server
from tokenslice.server.state import MIN_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT.parent / "shared" / "models" / "stories260k"
WINDOW_S = 5.0


def in_process(n_live: int) -> dict[str, Any]:
    llm = LLM(str(MODEL), dtype="float32", max_batch_size=16, kv_cache_blocks=4096)
    engine = llm.engine
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i in range(n_live):
        engine.add_request([1 + (i + j) % 200 for j in range(32)], params)
    for _ in range(20):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(200):
        engine.step()
    step_s = (time.perf_counter() - t0) / 200
    t0 = time.perf_counter()
    for _ in range(200):
        snap = engine.state()
    state_s = (time.perf_counter() - t0) / 200
    size = len(json.dumps(snap))
    llm.close()
    return {"live": n_live, "step_ms": step_s * 1e3, "state_ms": state_s * 1e3, "json_bytes": size,
            "engine_time_fraction": state_s / MIN_INTERVAL_S, "state_over_step": state_s / step_s}


def _viewer(url: str, stop: threading.Event) -> None:
    with httpx.stream("GET", url + "/v1/state/stream", timeout=60) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


def _load(url: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            with c.stream("POST", url + "/v1/completions", json={"model": str(MODEL), "prompt": "Once upon a time",
                                                                  "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break


def steps(url: str) -> int:
    return httpx.get(url + "/v1/state", timeout=60).json()["engine"]["num_steps"]


def over_http(rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"0": [], "1": [], "10": []}
    spec = ServerSpec(str(MODEL), ["--dtype", "float32", "--max-batch-size", "16", "--kv-cache-blocks", "4096"], threads=1)
    with running_server(spec, "fcfs") as url:
        stop = threading.Event()
        load = [threading.Thread(target=_load, args=(url, stop), daemon=True) for _ in range(32)]
        for t in load:
            t.start()
        time.sleep(3)
        for _ in range(rounds):
            for viewers in (0, 1, 10):
                vstop = threading.Event()
                vs = [threading.Thread(target=_viewer, args=(url, vstop), daemon=True) for _ in range(viewers)]
                for t in vs:
                    t.start()
                time.sleep(1)
                s0, t0 = steps(url), time.monotonic()
                time.sleep(WINDOW_S)
                out[str(viewers)].append((steps(url) - s0) / (time.monotonic() - t0))
                vstop.set()
                for t in vs:
                    t.join(10)
        stop.set()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [in_process(n) for n in (16, 256, 1000)]
    for r in rows:
        print(f"{r['live']:5d} live: step {r['step_ms']:.2f} ms, state {r['state_ms']:.3f} ms ({r['json_bytes']} B JSON): "
              f"{100 * r['engine_time_fraction']:.2f}% of engine time at 4 Hz")
    http = over_http(a.rounds)
    base = statistics.median(http["0"])
    for k, v in http.items():
        print(f"{k:>2} viewers: {statistics.median(v):.1f} steps/s ({100 * (statistics.median(v) / base - 1):+.1f}% vs none)")
    if a.out:
        Path(a.out).write_text(json.dumps({"in_process": rows, "http_steps_per_s": http}, indent=2) + "\n")


if __name__ == "__main__":
    main()
