"""Pipeline bubbles on the simulator, in the CPU setting of benchmarks/parallel/pipeline_parallel.py (the
real engine): the 56M Llama of benchmarks/common/llama56m.py (hidden 512, 8 layers), fp32, two stages with one
torch thread each, fcfs, a closed batch of requests (64 prompt + 64 new tokens), batch 8 — two
batches in flight against one.

Cost model: `tokenslice profile` of that checkpoint in one process with one thread (the whole
pass), made a 2-stage ProfileCostModel: each stage computes half the pass, and a batch's hidden
states (512 fp32 values a token) cross from stage to stage in the time a gloo send takes between
two processes on this machine (timed here, fitted as latency + bytes / bandwidth).

Printed per setting: simulated steps, virtual seconds, step and token throughput, and each
stage's bubble fraction (1 - busy / elapsed), for the full workload and for one too small to fill
two batches. `--real FILE` (the JSON of `pipeline_parallel.py --out FILE`) adds the real
engine's step throughput and the simulator's ratio to it (the target: within 15%), twice: with
the profile's equal stages, and with the stages and the engine loop as the real run measured
them for that many batches in flight: each stage's busy seconds over the equal split's (its
`stage_factors`: the LM head makes the last stage longer; stages computing at once on shared
cores each run slower), the spread of its per-plan times (`stage_cv`: with two batches and two
stages a late stage 0 stalls stage 1) and the loop's ms per plan (serial between a batch's
return and the next plan). What is left between fitted and real is the pipeline's own timing:
overlap, bubbles, the hops, and the real stages' waits on data already sent.

    PYTHONPATH=. .venv/bin/python benchmarks/parallel/pipeline_bubble_sim.py [--requests 16] [--real F] [--out F]  # ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenslice.bench.workloads import WorkloadRequest
from tokenslice.config import SchedulerConfig
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.sim.profile_options import ProfileOptions
from tokenslice.sim.profiler import run_profile
from tokenslice.sim.pipeline import PipelinedSimulatedExecutor
from tokenslice.predict.cost import CostModel
from tokenslice.predict.fit import fit_transfer
from tokenslice.predict.profile import ProfileCostModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import NEW, PROMPT, build_checkpoint  # noqa: E402

HIDDEN = 512  # llama56m.build_checkpoint's hidden size
SEND_TOKENS = (1, 8, 64, 512)
SEND_REPEATS = 30
JOIN_TIMEOUT_S = 120


def _ping_pong(rank: int, path: str, out: str) -> None:
    """Rank 0 sends [tokens, HIDDEN] fp32 to rank 1 and back; half the round trip is one send."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    rows = []
    for tokens in SEND_TOKENS:
        x = torch.zeros(tokens, HIDDEN)
        times = []
        for _ in range(SEND_REPEATS):
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - t) / 2)
        times.sort()
        rows.append((tokens * HIDDEN * 4, 1, times[len(times) // 2]))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure_send() -> list[tuple[int, int, float]]:
    """(bytes, 1, median seconds) of one stage-to-stage send per size, over gloo on this machine."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "sends.json"
        ctx = mp.start_processes(_ping_pong, args=(str(Path(d) / "rdv"), str(out)), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError("gloo send timing did not finish")
        return [tuple(r) for r in json.loads(out.read_text())]


def stage_cost(profile: ProfileCostModel, sends: list[tuple[int, int, float]]) -> ProfileCostModel:
    """The one-process profile as two stages of half the pass each plus the measured send."""
    data = profile.to_dict()
    return ProfileCostModel.from_dict({**data, "pipeline_parallel": 2, "activation_bytes_per_token": HIDDEN * 4,
                                       "p2p": vars(fit_transfer(sends))})


def simulate(cost: CostModel, requests: int, new: int, batch: int, in_flight: int) -> dict[str, Any]:
    cfg = SchedulerConfig(policy="fcfs", preemption="recompute", max_batch_size=batch)
    blocks = requests * (PROMPT + new) // 16 + 16
    eng = simulated_engine(cfg, cost, kv_cache_blocks=blocks, block_size=16, max_in_flight=in_flight)
    trace = [WorkloadRequest(f"r{i}", 0.0, None, PROMPT, new) for i in range(requests)]
    reqs = replay(eng, trace)
    assert all(r.is_finished for r in reqs)
    ex = eng.executor
    assert isinstance(ex, PipelinedSimulatedExecutor)
    span = eng.clock.now()
    return {"in_flight": in_flight, "requests": requests, "steps": eng.num_steps, "virtual_s": span,
            "steps_per_s": eng.num_steps / span, "tok_per_s": requests * new / span,
            "stage_busy_s": list(ex.stage_busy_s), "bubble": [1 - b / span for b in ex.stage_busy_s]}


def real_rows(path: str, a: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """The real engine's -pp 2 rows by plans in flight, from pipeline_parallel.py --out."""
    data = json.loads(Path(path).read_text())
    ran = data.get("args", {})
    same = (("requests", a.requests), ("new", a.new), ("max_batch_size", a.max_batch_size))
    if any(ran.get(k, v) != v for k, v in same):
        raise SystemExit(f"{path} ran another workload ({ran}): pass the same --requests, --new, --max-batch-size")
    rows = data["rows"]
    return {int(r["config"].split(",")[1].split()[0]): r for r in rows if r["config"].startswith("-pp 2,")}


def fit_to_real(cost: ProfileCostModel, real: dict[str, Any], requests: int, new: int, batch: int,
                in_flight: int) -> ProfileCostModel:
    """`cost` with each stage's time scaled to the real run's busy seconds over the equal split's
    on the same workload, spread as the real decode plans' were, and the real engine loop's ms
    per plan as the loop's time."""
    equal = simulate(cost, requests, new, batch, in_flight)
    factors = [r / s for r, s in zip(real["stage_busy_s"], equal["stage_busy_s"])]
    spread = real["decode_stage_cv"][max(real["decode_stage_cv"], key=int)]  # the largest decode batch's
    return ProfileCostModel.from_dict({**cost.to_dict(), "stage_factors": factors, "stage_cv": spread,
                                       "loop": {"base": real["loop_ms_per_step"] / 1000}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--new", type=int, default=NEW)
    ap.add_argument("--samples", type=int, default=24, help="profile grid points")
    ap.add_argument("--real", default=None, help="JSON written by pipeline_parallel.py --out")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # as each stage worker of the real benchmark
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        report = run_profile(ProfileOptions(model=d, dtype="float32", samples=a.samples, repeats=3, max_context=256))
    sends = measure_send()
    cost = stage_cost(report.cost, sends)
    real = real_rows(a.real, a) if a.real else {}
    rows, fitted = [], {}
    for requests in (a.requests, max(1, a.max_batch_size // 2)):
        for m in (2, 1):
            rows.append(simulate(cost, requests, a.new, a.max_batch_size, m))
    for m, r in real.items():
        fit = fit_to_real(cost, r, a.requests, a.new, a.max_batch_size, m)
        fitted[m] = {**simulate(fit, a.requests, a.new, a.max_batch_size, m), "stage_factors": fit.stage_factors,
                     "stage_cv": fit.stage_cv,
                     "loop_ms": 1000 * fit.loop["base"], "real_steps_per_s": r["steps_per_s"]}
    print(f"model {params / 1e6:.1f}M params fp32; profile r2 {report.cost.r2:.3f} over {len(report.samples)} points; "
          f"send {', '.join(f'{b // (HIDDEN * 4)} tok {s * 1e6:.0f} us' for b, _, s in sends)}; "
          f"{time.perf_counter() - t0:.0f} s wall")
    print(f"{'requests':>8} {'in flight':>9} {'steps':>6} {'virtual s':>10} {'steps/s':>8} {'tok/s':>7}  bubble per stage"
          + ("   real steps/s  sim/real" if real else ""))
    for r in rows:
        line = (f"{r['requests']:>8} {r['in_flight']:>9} {r['steps']:>6} {r['virtual_s']:>10.3f} {r['steps_per_s']:>8.1f} "
                f"{r['tok_per_s']:>7.1f}  " + " ".join(f"{b:.0%}" for b in r["bubble"]))
        if r["requests"] == a.requests and r["in_flight"] in real:
            got = real[r["in_flight"]]["steps_per_s"]
            line += f"   {got:>12.1f}  {r['steps_per_s'] / got:.2f}"
        print(line)
    if fitted:
        print("fitted to the real run (stage factors, per-plan spread, loop ms per plan):")
        print(f"{'in flight':>9} {'factors':>12} {'spread':>12} {'loop ms':>8} {'steps/s':>8}  bubble per stage"
              "   real steps/s  sim/real")
        for m, r in sorted(fitted.items(), reverse=True):
            print(f"{m:>9} {'/'.join(f'{f:.2f}' for f in r['stage_factors']):>12} "
                  f"{'/'.join(f'{c:.2f}' for c in r['stage_cv']):>12} {r['loop_ms']:>8.2f} "
                  f"{r['steps_per_s']:>8.1f}  " + " ".join(f"{b:.0%}" for b in r["bubble"]) +
                  f"   {r['real_steps_per_s']:>12.1f}  {r['steps_per_s'] / r['real_steps_per_s']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"params": params, "profile": report.to_json(), "sends": sends,
                                           "cost": cost.to_dict(), "rows": rows, "fitted": fitted,
                                           "real": {m: r["steps_per_s"] for m, r in real.items()},
                                           "cpu_count": os.cpu_count()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
