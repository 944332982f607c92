"""Tensor parallelism on CPU: decode step time of -tp 2 (two worker processes, gloo) against -tp 1.

The 56M Llama of benchmarks/common/llama56m.py (hidden 512, 8 layers, 8 heads, 4 KV heads), fp32,
64 prompt + 64 generated tokens per request. Configurations: -tp 1 with one torch thread, -tp 1
with as many threads as -tp 2 has processes (the same cores), and -tp 2 with one thread per
worker, in worker processes (--executor mp) and in Ray actors of a private one-node cluster
(--executor ray: the same rank code, plans as actor calls instead of ZMQ messages). The time is the engine step's wall time over decode-only steps (scheduling, messages,
all-reduces and sampling included).

    PYTHONPATH=. .venv/bin/python benchmarks/parallel/tensor_parallel.py [--batches 1,16] \
        [--out benchmarks/parallel/results/tensor_parallel.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenslice import LLM, SamplingParams
from tokenslice.plan import StepPlan, StepResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import NEW, PROMPT, build_checkpoint, prompts  # noqa: E402


def decode_step_ms(llm: LLM, batch: int) -> tuple[float, float]:
    """Median milliseconds of the decode-only steps of one batch run to completion: the engine
    step's wall time, and the executor's own step time (the slowest rank's, all-reduces
    included; the rest of the wall time is scheduling and, with workers, the messages)."""
    eng = llm.engine
    llm.generate(prompts(2).tolist(), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for p in prompts(batch).tolist():
        eng.add_request(p, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    reported: list[float] = []
    execute = eng.executor.execute

    def timed(plan: StepPlan) -> StepResult:
        result = execute(plan)
        reported.append(result.step_seconds)
        return result

    eng.executor.execute = timed
    walls, execs = [], []
    while eng.has_unfinished():
        decode = all(r.num_computed_tokens > 0 for r in eng.scheduler.requests.values())
        t = time.perf_counter()
        eng.step()
        if decode:
            walls.append(time.perf_counter() - t)
            execs.append(reported[-1])
    eng.executor.execute = execute
    return 1000 * statistics.median(walls), 1000 * statistics.median(execs)


def _allreduce_worker(rank: int, init: str, rows: list[int], out: torch.multiprocessing.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    times = {}
    for n in rows:
        x = torch.randn(n, 512)
        for _ in range(20):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        times[n] = (time.perf_counter() - t) / 200 * 1e6
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_us(rows: list[int]) -> dict[int, float]:
    """Microseconds of one gloo all-reduce of [rows, 512] fp32 between two processes: a -tp 2
    decode step of this model makes 18 (two per layer, the embedding's, the head's gather)."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_allreduce_worker, args=(r, f"file://{d}/init", rows, out)) for r in range(2)]
        for p in procs:
            p.start()
        times = out.get(timeout=300)
        for p in procs:
            p.join(60)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    configs = [("-tp 1, 1 thread", 1, 1, "auto"), ("-tp 1, 2 threads", 1, 2, "auto"),
               ("-tp 2, 1 thread/rank", 2, 2, "mp"), ("-tp 2 Ray, 1 thread/rank", 2, 2, "ray")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        for label, tp, threads, executor in configs:
            torch.set_num_threads(threads)  # -tp 2: each worker gets threads // tp
            with LLM(d, dtype="float32", tensor_parallel_size=tp, executor=executor,
                     max_batch_size=max(batches), kv_cache_blocks=max(batches) * (PROMPT + NEW) // 16 + 8) as llm:
                for b in batches:
                    wall, model = decode_step_ms(llm, b)
                    rows.append({"config": label, "batch": b, "step_ms": wall, "executor_step_ms": model})
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; model {params / 1e6:.1f}M params fp32; median decode step")
    print(f"{'config':<26}{'batch':>6}{'step ms':>10}{'executor ms':>13}")
    for r in rows:
        print(f"{r['config']:<26}{r['batch']:>6}{r['step_ms']:>10.2f}{r['executor_step_ms']:>13.2f}")
    collective = allreduce_us(batches)
    print("gloo all-reduce of [batch, 512] fp32, 2 processes: "
          + ", ".join(f"batch {b}: {us:.0f} us" for b, us in collective.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"params": params, "rows": rows, "allreduce_us": collective}, indent=2))


if __name__ == "__main__":
    main()
