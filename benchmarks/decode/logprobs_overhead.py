"""Decode step time with logprobs off vs `logprobs: 5` on every request.

The 56M Llama of benchmarks/common/llama56m.py (fp32), 64 prompt + 32 generated tokens per request, greedy,
at each batch size. Off and on alternate (repeats interleaved) on one engine so machine noise
hits both alike; reported: the median over repeats of the mean decode-only step time, and the
ratio on/off (target: at most 1.15).

    .venv/bin/python benchmarks/decode/logprobs_overhead.py [--batches 16,64] [--repeats 5] [--device cpu]
        [--threads 1] [--out benchmarks/decode/results/logprobs_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenslice import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import build_checkpoint, prompts  # noqa: E402

NEW = 32
TOP = 5


def decode_step_s(llm: LLM, batch: int, logprobs: int | None) -> float:
    """Mean wall seconds of the decode-only steps of one batch run to completion."""
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=logprobs)
    return decode_step_seconds(llm.engine, batch, sp)


def decode_step_seconds(eng: Any, batch: int, sp: Any, prompt_ids: list[list[int]] | None = None) -> float:
    """Mean wall seconds of the decode-only steps of `batch` prompts (`prompt_ids`, else this
    benchmark's) run to completion on `eng` (an Engine; also used by decode_step_versions.py on
    older checkouts, so nothing newer)."""
    for p in prompt_ids if prompt_ids is not None else prompts(batch).tolist():
        eng.add_request(p, sp)
    total, steps = 0.0, 0
    while eng.has_unfinished():
        decode = all(r.num_computed_tokens > 0 for r in eng.scheduler.requests.values())
        t0 = time.perf_counter()
        eng.step()
        if decode:
            if eng.runner.device.type == "cuda":
                torch.cuda.synchronize()
            total += time.perf_counter() - t0
            steps += 1
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    # One thread by default: two OpenMP threads next to any busy process stall at every barrier
    # on the 2-core development box (BENCHMARKS.md's note on CPU timing).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    torch.set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        with LLM(d, dtype="float32", device=a.device, max_batch_size=max(batches), kv_cache_blocks=1024) as llm:
            decode_step_s(llm, 4, TOP)  # warm-up, both paths
            decode_step_s(llm, 4, None)
            for b in batches:
                off, on = [], []
                for _ in range(a.repeats):  # interleaved: drift and noise hit both
                    off.append(decode_step_s(llm, b, None))
                    on.append(decode_step_s(llm, b, TOP))
                m_off, m_on = statistics.median(off), statistics.median(on)
                rows.append({"batch": b, "off_ms": 1e3 * m_off, "on_ms": 1e3 * m_on, "ratio": m_on / m_off,
                             "off_all_ms": [1e3 * x for x in off], "on_all_ms": [1e3 * x for x in on]})
                print(f"batch {b:3d}: decode step {1e3 * m_off:7.2f} ms off, {1e3 * m_on:7.2f} ms with logprobs={TOP} "
                      f"-> {m_on / m_off:.3f}x", flush=True)
    result = {"benchmark": "logprobs_overhead", "params": params, "device": a.device, "top": TOP,
              "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
