"""Pipeline parallelism on CPU: two stages (-pp 2, gloo) with two batches in flight against one.

The 56M Llama of benchmarks/common/llama56m.py (hidden 512, 8 layers: 4 per stage), fp32. A
closed batch of requests (64 prompt + 64 generated tokens each) runs to completion under fcfs
with `--max-batch-size` per batch. Configurations:

- `-pp 2, 2 in flight`: the engine keeps two plans in the pipe (FastServe §4.3), each stage
  works on a different batch;
- `-pp 2, 1 in flight`: the same workers, the engine waits for each plan (Engine.max_in_flight
  = 1), so one stage always idles;
- `-pp 2 (a+b layers), 2 in flight`: two in flight again, the layers split (`--pipeline-layers`)
  so that the stages' CPU seconds measured with one in flight even out (the last stage also
  computes the LM head); left out when that split is 4+4;
- `-pp 1`: one process, one torch thread (reference).

Printed per configuration: engine steps, wall seconds, step throughput (steps/s) and token
throughput, and per stage its busy seconds (swaps + compute, waits excluded), its waits for
a neighbour, and its bubble fraction 1 - busy / wall; then the per-stage time per plan (mean
ms) by decode batch size, the numbers a simulator's pipeline cost model needs; then where
the time went: the engine loop's own ms per plan (schedule + submit, update: serial between a
batch's return and the next plan's submit) and the CPU seconds each process used (Linux), which
against busy seconds shows whether a process was kept off a core (CPU < busy) or spun (CPU >
busy + its share of the loop).

    PYTHONPATH=. .venv/bin/python benchmarks/parallel/pipeline_parallel.py [--requests 16] [--max-batch-size 8] [--out F]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from tokenslice import LLM, SamplingParams
from tokenslice.config import ModelConfig
from tokenslice.model.loader import load_arch
from tokenslice.model.pp import balanced_counts
from tokenslice.plan import StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import NEW, PROMPT, build_checkpoint, prompts  # noqa: E402


def cpu_seconds() -> list[float]:
    """CPU seconds (user + system) used so far by each worker process (by rank), then by this one."""
    out = []
    for p in sorted(multiprocessing.active_children(), key=lambda p: int(p.name.removeprefix("tokenslice-tp"))):
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except OSError:  # no procfs: not reported
            pass
    own = resource.getrusage(resource.RUSAGE_SELF)
    return [*out, own.ru_utime + own.ru_stime]


def run(llm: LLM, requests: int, in_flight: int, new: int) -> dict:
    """Run `requests` requests to completion with `in_flight` plans in the pipe at most."""
    eng = llm.engine
    eng.max_in_flight = in_flight
    llm.generate(prompts(2).tolist(), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    ex = eng.executor
    staged = hasattr(ex, "stage_busy_s")
    busy0 = list(ex.stage_busy_s) if staged else [0.0]
    wait0 = list(ex.stage_wait_s) if staged else [0.0]
    by_batch: dict[int, list[list[float]]] = defaultdict(list)  # decode batch -> per-plan stage ms
    if staged:
        poll, submitted = ex.poll, []
        submit = ex.submit

        def sub(plan: StepPlan) -> None:
            submit(plan)
            submitted.append(plan)

        def timed_poll():
            before = list(ex.stage_busy_s)
            result = poll()
            plan = submitted.pop(0)
            if plan.decode and not plan.prefill:
                by_batch[len(plan.decode)].append([1000 * (a - b) for a, b in zip(ex.stage_busy_s, before)])
            return result
        ex.submit, ex.poll = sub, timed_poll
    steps0 = eng.num_steps
    for p in prompts(requests).tolist():
        eng.add_request(p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    loop0, cpu0 = eng.timings.schedule_s + eng.timings.update_s, cpu_seconds()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t
    loop_s = eng.timings.schedule_s + eng.timings.update_s - loop0
    cpu = [b - a for a, b in zip(cpu0, cpu_seconds())]
    if staged:
        del ex.submit, ex.poll
    steps = eng.num_steps - steps0
    busy = [a - b for a, b in zip(ex.stage_busy_s, busy0)] if staged else [wall]
    wait = [a - b for a, b in zip(ex.stage_wait_s, wait0)] if staged else [0.0]
    return {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "tok_per_s": requests * new / wall,
            "stage_busy_s": busy, "stage_wait_s": wait, "bubble": [1 - b / wall for b in busy],
            "loop_ms_per_step": 1000 * loop_s / steps, "cpu_s": cpu,
            "decode_stage_ms": {b: [statistics.mean(col) for col in zip(*rows)]
                                for b, rows in sorted(by_batch.items())},
            "decode_stage_cv": {b: [statistics.pstdev(col) / statistics.mean(col) for col in zip(*rows)]
                                for b, rows in sorted(by_batch.items())}}


def measured_split(row: dict, num_layers: int) -> tuple[int, ...]:
    """Layers per stage that even out the two stages' measured CPU seconds (on a loaded box
    busy seconds also count time off-core): stage 0's per layer, and what stage 1 spends beyond
    its layers (the LM head)."""
    s0, s1 = row["cpu_s"][:2]
    per_layer = s0 / (num_layers // 2)
    return balanced_counts(per_layer, max(s1 - (num_layers - num_layers // 2) * per_layer, 0.0), num_layers, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--new", type=int, default=NEW)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    blocks = args.requests * (PROMPT + args.new) // 16 + 16
    common = dict(dtype="float32", policy="fcfs", max_batch_size=args.max_batch_size, kv_cache_blocks=blocks)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        torch.set_num_threads(2)  # each of the two stage workers gets one thread
        with LLM(d, pipeline_parallel_size=2, **common) as llm:
            for m in (2, 1):
                rows.append({"config": f"-pp 2, {m} in flight", **run(llm, args.requests, m, args.new)})
        layers = load_arch(ModelConfig(d)).num_layers
        split = measured_split(rows[-1], layers)
        if split != (layers // 2, layers - layers // 2):
            with LLM(d, pipeline_parallel_size=2, pipeline_layers=",".join(map(str, split)), **common) as llm:
                rows.append({"config": f"-pp 2 ({'+'.join(map(str, split))} layers), 2 in flight",
                             **run(llm, args.requests, 2, args.new)})
        torch.set_num_threads(1)
        with LLM(d, **common) as llm:
            rows.append({"config": "-pp 1, 1 thread", **run(llm, args.requests, 1, args.new)})
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"model {params / 1e6:.1f}M params fp32; {args.requests} requests x ({PROMPT} prompt + {args.new} new), "
          f"max batch {args.max_batch_size}, fcfs")
    print(f"{'config':<34}{'steps':>7}{'wall s':>9}{'steps/s':>9}{'tok/s':>8}  stage busy s / wait s / bubble")
    for r in rows:
        stages = "  ".join(f"[{b:.2f} / {w:.2f} / {f:.0%}]"
                           for b, w, f in zip(r["stage_busy_s"], r["stage_wait_s"], r["bubble"]))
        print(f"{r['config']:<34}{r['steps']:>7}{r['wall_s']:>9.2f}{r['steps_per_s']:>9.1f}"
              f"{r['tok_per_s']:>8.1f}  {stages}")
    print("per-stage busy ms per decode-only plan, by batch size (stage 0, stage 1):")
    for r in rows:
        if not r["config"].startswith("-pp 2"):
            continue
        cells = ", ".join(f"{b}: " + "/".join(f"{x:.1f}" for x in ms) for b, ms in r["decode_stage_ms"].items())
        print(f"  {r['config']}: {cells}")
    print("engine loop ms per plan; CPU s per process (workers by rank, then the engine's; Linux):")
    for r in rows:
        cpu = " / ".join(f"{c:.2f}" for c in r["cpu_s"])
        print(f"  {r['config']}: loop {r['loop_ms_per_step']:.2f} ms; CPU {cpu}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"params": params, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
