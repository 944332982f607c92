"""Where a decode step's time goes, in the engine and behind the HTTP server.

Models: ../shared/models/stories260k and the 24M-parameter Llama (benchmarks/common/llama24m.py), fp32,
on this machine's CPU; batches of 1 and 16 requests, 64-token prompts, 128 generated tokens
(ignore_eos, greedy). Only decode steps are counted (every request past its prompt).

Engine (in this process, `LLM`), per decode step, in milliseconds:
  schedule   Scheduler.schedule (StepTimings.schedule_s)
  prepare    the plan turned into tensors (ModelRunner.prep_seconds)
  forward    the model's forward pass (forward hooks on the model, registered only here)
  sample     logits of the last rows + Sampler.sample (timed by wrapping the sampler, here only)
  exec other the rest of executor.execute (KV transfers bookkeeping, result assembly)
  update     Scheduler.update + detokenization + stop strings (StepTimings.update_s)
  outputs    building RequestOutputs in Engine.step
Server (`tokenslice serve`, engine core in its own process unless --no-engine-process, step
trace on), same requests streamed over HTTP at once:
  in-step    schedule + execute + update as the core's step trace records them
  core loop  the core's time between steps (receiving, sending outputs) = step interval - in-step
  api cpu    CPU milliseconds the API-server process spends per step (detokenize, SSE, HTTP;
             with --no-engine-process the engine's own compute too: one process)
  tok/s      tokens the client received per second, decode part

    .venv/bin/python benchmarks/decode/step_breakdown.py [--models stories260k,24m] [--batches 1,16]
        [--server-mode process|thread|both|none] [--serve-args "--api-server-cpus 0"] [--no-engine]
        [--out benchmarks/decode/results/step_breakdown.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


from tokenslice import LLM, SamplingParams  # noqa: E402
from tokenslice.bench.client import LoadClient  # noqa: E402
from tokenslice.bench.client_config import ClientConfig  # noqa: E402
from tokenslice.bench.request_stream import synthetic_prompt_ids  # noqa: E402
from tokenslice.bench.server_counters import wait_idle  # noqa: E402
from tokenslice.bench.sweep import ServerProcess, ServerSpec  # noqa: E402
from tokenslice.bench.workloads import WorkloadRequest  # noqa: E402
from tokenslice.config import CpuConfig  # noqa: E402
from tokenslice.engine.cpus import plan_cpus  # noqa: E402
from tokenslice.engine.step_trace import load_step_trace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama24m import STORIES, build_llama24m  # noqa: E402

PROMPT, NEW = 64, 128
ENGINE_COLUMNS = ("schedule", "prepare", "forward", "sample", "exec_other", "update", "outputs")


class _Stopwatch:
    """Sums wall time between start() and stop() calls."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t = 0.0

    def start(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def stop(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._t


def _timed(fn: Callable[..., Any], watch: _Stopwatch) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        watch.start()
        try:
            return fn(*args, **kwargs)
        finally:
            watch.stop()
    return wrapper


def engine_breakdown(model: str, batch: int, steps: int = NEW) -> dict[str, float]:
    """Mean milliseconds per decode step in each phase, and the step's total."""
    llm = LLM(model, dtype="float32", max_batch_size=max(batch, 1), kv_cache_blocks=batch * (PROMPT + NEW) // 16 + 16)
    eng = llm.engine
    runner = eng.runner
    fwd, smp = _Stopwatch(), _Stopwatch()
    hooks = [runner.model.register_forward_pre_hook(fwd.start), runner.model.register_forward_hook(fwd.stop)]
    runner.sampler.sample = _timed(runner.sampler.sample, smp)
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([synthetic_prompt_ids(PROMPT, 99)], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    for i in range(batch):
        eng.add_request(synthetic_prompt_ids(PROMPT, i), sp)
    sums = dict.fromkeys(ENGINE_COLUMNS, 0.0)
    total = 0.0
    n = 0
    tm = eng.timings
    while eng.has_unfinished():
        decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.requests.values())
        before = (tm.schedule_s, tm.execute_s, tm.update_s, getattr(runner, "prep_seconds", 0.0), fwd.total, smp.total)
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        if not decode:
            continue
        sched, exe, upd = (tm.schedule_s - before[0], tm.execute_s - before[1], tm.update_s - before[2])
        prep = getattr(runner, "prep_seconds", 0.0) - before[3]
        f, s = fwd.total - before[4], smp.total - before[5]
        for k, v in zip(ENGINE_COLUMNS, (sched, prep, f, s, exe - prep - f - s, upd, wall - sched - exe - upd),
                        strict=True):
            sums[k] += v
        total += wall
        n += 1
    for h in hooks:
        h.remove()
    llm.close()
    row = {k: 1000 * v / n for k, v in sums.items()}
    row["step"] = 1000 * total / n
    row["tok_s"] = batch * n / total
    row["steps"] = n
    return row


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def server_breakdown(model: str, batch: int, engine_process: bool, extra: list[str] | None = None
                     ) -> dict[str, float]:
    """Per decode step of a served batch: in-step ms, core-loop ms, API-server CPU ms, client tok/s."""
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "steps.jsonl"
        args = ["--dtype", "float32", "--max-batch-size", str(max(batch, 1)),
                "--kv-cache-blocks", str(batch * (PROMPT + NEW) // 16 + 16), "--step-trace", str(trace),
                "--engine-process" if engine_process else "--no-engine-process", *(extra or [])]
        server = ServerProcess(ServerSpec(model, args), "fcfs")
        try:
            server.wait_ready()
            cfg = ClientConfig(server.url, request_timeout_s=300.0)
            client = LoadClient(cfg)
            warm = [WorkloadRequest(request_id="w", arrival_time=0.0, prompt=None, prompt_len=PROMPT, output_len=8,
                                    prompt_token_ids=synthetic_prompt_ids(PROMPT, 99))]
            client.run(warm)
            wait_idle(cfg)
            trace.write_text("")
            reqs = [WorkloadRequest(request_id=f"r{i}", arrival_time=0.0, prompt=None, prompt_len=PROMPT,
                                    output_len=NEW, prompt_token_ids=synthetic_prompt_ids(PROMPT, i))
                    for i in range(batch)]
            api = server.proc.pid
            cpu0 = _cpu_seconds(api)
            result = client.run(reqs)
            cpu1 = _cpu_seconds(api)
            wait_idle(cfg)
        finally:
            server.stop()
        recs = [r for r in load_step_trace(trace) if not r.prefill and r.decode]
    bad = [r for r in result.records if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
    in_step = [r.schedule_s + r.execute_s + r.update_s for r in recs]
    gaps = [b.start - a.start for a, b in zip(recs, recs[1:], strict=False)]
    # Client side: decode tokens over the span from each request's first to last token.
    first = min(t.token_times[1] for t in result.records)
    last = max(t.token_times[-1] for t in result.records)
    decode_tokens = sum(len(t.token_times) - 1 for t in result.records)
    interval = statistics.mean(gaps)
    return {"in_step": 1000 * statistics.mean(in_step), "core_loop": 1000 * (interval - statistics.mean(in_step)),
            "interval": 1000 * interval, "api_cpu": 1000 * (cpu1 - cpu0) / max(1, len(recs)),
            "tok_s": decode_tokens / (last - first), "steps": len(recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="stories260k,24m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--server-mode", default="process", choices=("process", "thread", "both", "none"))
    ap.add_argument("--serve-args", default="", help="extra `tokenslice serve` flags for the server runs")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                    help="the in-process engine breakdown (--no-engine: server runs only)")
    ap.add_argument("--threads", type=int, default=plan_cpus(CpuConfig()).engine_threads,
                    help="torch threads for the in-process engine (default: what serve gives its core)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    modes = {"process": [True], "thread": [False], "both": [True, False], "none": []}[args.server_mode]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        paths = {"stories260k": str(STORIES)}
        if "24m" in args.models.split(","):
            build_llama24m(Path(d) / "llama24m")
            paths["24m"] = str(Path(d) / "llama24m")
        for name in args.models.split(","):
            for b in batches:
                row: dict[str, Any] = {"model": name, "batch": b}
                if args.engine:
                    row["engine"] = engine_breakdown(paths[name], b)
                for proc in modes:
                    row["server_" + ("process" if proc else "thread")] = server_breakdown(
                        paths[name], b, proc, args.serve_args.split())
                rows.append(row)
                print(f"done {name} batch {b}", file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads in this process, {os.cpu_count()} CPUs; "
          f"decode steps of {PROMPT}-token prompts, {NEW} new tokens; ms per step")
    head = f"{'model':<12}{'batch':>6}" + "".join(f"{c:>11}" for c in (*ENGINE_COLUMNS, "step", "tok/s"))
    print("engine (LLM in this process)\n" + head)
    for r in (r for r in rows if "engine" in r):
        e = r["engine"]
        print(f"{r['model']:<12}{r['batch']:>6}" + "".join(f"{e[c]:>11.3f}" for c in (*ENGINE_COLUMNS, "step"))
              + f"{e['tok_s']:>11.0f}")
    for key in ("server_process", "server_thread"):
        if not any(key in r for r in rows):
            continue
        print(f"{key.replace('_', ' ')} (tokenslice serve)\n{'model':<12}{'batch':>6}"
              + "".join(f"{c:>11}" for c in ("in-step", "core loop", "interval", "api cpu", "tok/s")))
        for r in rows:
            s = r[key]
            print(f"{r['model']:<12}{r['batch']:>6}" + "".join(
                f"{s[c]:>11.3f}" for c in ("in_step", "core_loop", "interval", "api_cpu")) + f"{s['tok_s']:>11.0f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
