"""Fairness over HTTP on the real engine: vtc vs fcfs when one user sends 10x each other's rate.

Each policy runs in its own `tokenslice serve` child process (../shared/models/stories260k, fp32,
one PyTorch thread, max batch 16, ample KV); this process is only the HTTP client. The workload
is synthetic-lognormal (prompt mean 64, output mean 128 tokens, at most 255 each, so that every
request fits the 512-token context), N requests, four users drawn by shares 10,1,1,1: user-0 is
the heavy one. The light users' mean TTFT is what fair scheduling protects.

Rules fixed before any result was seen:
  * rates = fixed fractions (0.8, 1.0, 1.2) of fcfs's saturation throughput over HTTP on the same
    workload (all N requests sent at t = 0: N / makespan), measured first in the same run;
  * both servers run side by side and the policies take turns at each rate (`--interleave`), so
    that load from other jobs on this shared box drifts over both alike; no early stop.

    .venv/bin/python benchmarks/scheduling/fair_http.py [--num-requests 400] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tokenslice.bench.client import LoadClient
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.server_counters import wait_idle
from tokenslice.bench.metrics import summarize
from tokenslice.bench.sweep import BenchSpec, ServerSpec, run_bench, running_server
from tokenslice.bench.datasets import DatasetCache

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT.parent / "shared" / "models" / "stories260k"
POLICIES = ["fcfs", "vtc"]
FRACTIONS = (0.8, 1.0, 1.2)
SHARES = "10,1,1,1"
HEAVY = "user-0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "scheduling" / "results" / "fair_http_n400_seed0.json"))
    args = ap.parse_args()
    spec = BenchSpec(workload="synthetic-lognormal", policies=POLICIES, rates=[1.0], num_requests=args.num_requests,
                     seed=args.seed, input_len=64, output_len=128, max_len=255, user_shares=SHARES,
                     early_stop_factor=None, warmup_requests=8, interleave=True)
    server = ServerSpec(model=str(MODEL), threads=1, args=["--dtype", "float32", "--max-batch-size", "16",
                                                           "--kv-cache-blocks", str(args.num_requests * 512 // 16)])
    client = ClientConfig(base_url="", prompt_format="synthetic")
    cache = DatasetCache()
    with running_server(server, "fcfs") as url:
        lc = LoadClient(dataclasses.replace(client, base_url=url))
        lc.run([dataclasses.replace(r, arrival_time=0.0) for r in spec.make(None, cache)[:8]])  # warm-up
        wait_idle(lc.cfg)
        sat = summarize(lc.run(spec.make(None, cache)).records)["throughput_rps"]
    rates = [round(f * sat, 2) for f in FRACTIONS]
    print(f"fcfs saturation over HTTP {sat:.2f} req/s; rates {rates}", flush=True)
    results = run_bench(dataclasses.replace(spec, rates=rates), client, server)
    results["summary"]["fcfs_saturation_rps"] = sat
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    print(f"\nN = {args.num_requests}, seed {args.seed}, user shares {SHARES} ({HEAVY} heavy)")
    print(f"{'load':>5} {'policy':>6} {'light mean TTFT s':>18} {'heavy mean TTFT s':>18} {'Jain service':>13}")
    light: dict[tuple[float, str], float] = {}
    for run in sorted(results["runs"], key=lambda r: (r["rate"], r["policy"])):
        users = run["per_user"]
        lights = [u for name, u in users.items() if name != HEAVY]
        # Mean over the light users' requests (not over users): every light request counts once.
        n = sum(u["num_finished"] for u in lights)
        ttft = sum(u["mean_ttft"] * u["num_finished"] for u in lights if u["mean_ttft"] is not None) / n
        load = run["rate"] / sat
        light[(round(load, 2), run["policy"])] = ttft
        print(f"{load:5.2f} {run['policy']:>6} {ttft:18.3f} {users[HEAVY]['mean_ttft']:18.3f} "
              f"{run['metrics']['jain_service']:13.3f}")
    for f in FRACTIONS:
        print(f"load {f}: light users' mean TTFT, vtc / fcfs = {light[(f, 'vtc')] / light[(f, 'fcfs')]:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
