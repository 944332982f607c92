"""Tensor parallelism on CPU: decode step time of -tp 2 (two worker processes, gloo) against -tp 1.

The 56M Llama of benchmarks/engine_vs_hf.py (hidden 512, 8 layers, 8 heads, 4 KV heads), fp32,
64 prompt + 64 generated tokens per request. Configurations: -tp 1 with one torch thread, -tp 1
with as many threads as -tp 2 has processes (the same cores), and -tp 2 with one thread per
worker. The time is the engine step's wall time over decode-only steps (scheduling, messages,
all-reduces and sampling included).

    .venv/bin/python benchmarks/tensor_parallel.py [--batches 1,16] [--out results/tensor_parallel.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine_vs_hf import NEW, PROMPT, build_checkpoint, prompts
from tokenslice import LLM, SamplingParams


def decode_step_ms(llm: LLM, batch: int) -> float:
    """Median wall milliseconds of the decode-only steps of one batch run to completion."""
    eng = llm.engine
    llm.generate(prompts(2).tolist(), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for p in prompts(batch).tolist():
        eng.add_request(p, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        decode = all(r.num_computed_tokens > 0 for r in eng.scheduler.requests.values())
        t = time.perf_counter()
        eng.step()
        if decode:
            steps.append(time.perf_counter() - t)
    return 1000 * statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    configs = [("-tp 1, 1 thread", 1, 1), ("-tp 1, 2 threads", 1, 2), ("-tp 2, 1 thread/rank", 2, 2)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        for label, tp, threads in configs:
            torch.set_num_threads(threads)  # -tp 2: each worker gets threads // tp
            with LLM(d, dtype="float32", tensor_parallel_size=tp, max_batch_size=max(batches),
                     kv_cache_blocks=max(batches) * (PROMPT + NEW) // 16 + 8) as llm:
                rows.append({"config": label, **{f"batch_{b}_step_ms": decode_step_ms(llm, b) for b in batches}})
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; model {params / 1e6:.1f}M params fp32; median decode step (ms)")
    print(f"{'config':<22}" + "".join(f"{'batch ' + str(b):>10}" for b in batches))
    for r in rows:
        print(f"{r['config']:<22}" + "".join(f"{r[f'batch_{b}_step_ms']:>10.2f}" for b in batches))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
