"""Scheduling over HTTP on the real engine: fcfs vs skip-join-mlfq vs srpt-oracle, max rate under
the SLO (paper protocol, as `tokenslice bench` measures it).

Each policy runs in its own `tokenslice serve` child process (../shared/models/stories260k, fp32,
one PyTorch thread, max batch 16, ample KV, the policies' cost model from `tokenslice profile`
run at the start); this process is only the HTTP client, timing every streamed token.

Workloads: Alpaca and ShareGPT (first turns) with GPT-2 token counts (OPT's, as the papers
count), vLLM's length filter, prompt <= 256 and output <= 255 tokens so that every request fits
the model's 512-token context. Prompts are sent as token ids of exactly the dataset's prompt
length (GPT-2 ids are not stories260k's vocabulary), outputs run to the dataset's length
(max_tokens + ignore_eos), and srpt-oracle gets that length as `tokenslice.expected_output_tokens`.

Rules fixed before any result was seen:
  * SLO = 10x the decode iteration time a lone request sees over HTTP on the fcfs server
    (the paper protocol's "10x the decode iteration time", measured the way the client sees it);
  * rates = fixed fractions of fcfs's saturation throughput over HTTP on the same workload
    (all N requests sent at t = 0: N / makespan), measured first in the same run;
  * a policy's sweep stops once it is clearly past the SLO (`tokenslice bench`'s early stop);
  * the three servers run side by side and the policies take turns at each rate (`--interleave`),
    so that load from other jobs on this shared box drifts over all policies alike.

    flock /tmp/tokenslice-bench.lock .venv/bin/python benchmarks/scheduling/bench_http_sched.py \\
        [--num-requests 300] [--seed 0] \\
        | tee benchmarks/scheduling/results/bench_http_sched_n300_seed0.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tokenslice.bench.client import LoadClient
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.server_counters import wait_idle
from tokenslice.bench.metrics import SLO, summarize
from tokenslice.bench.report import format_summary, format_table, plot_results
from tokenslice.bench.sweep import SLO_DECODE_FACTOR, BenchSpec, ServerSpec, run_bench, running_server
from tokenslice.bench.datasets import DatasetCache

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "stories260k"
POLICIES = ["fcfs", "skip-join-mlfq", "srpt-oracle"]
BATCH = 16
CONTEXT = 512
FRACTIONS = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)  # a finite trace only queues up well past saturation


def make_profile(path: Path) -> float:
    """`tokenslice profile` for this machine, one thread (the servers run with one too)."""
    import torch

    from tokenslice.sim.profile_options import ProfileOptions
    from tokenslice.sim.profiler import run_profile

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    report = run_profile(ProfileOptions(model=str(MODEL), dtype="float32", max_batch_size=BATCH, max_context=CONTEXT))
    report.cost.save(path)
    return time.perf_counter() - t0


def spec_for(workload: str, n: int, seed: int) -> BenchSpec:
    return BenchSpec(workload=workload, policies=POLICIES, rates=[1.0], num_requests=n, seed=seed,
                     dataset=str(SHARED / "data"), tokenizer=str(SHARED / "tokenizers" / "gpt2"), length_filter=True,
                     max_prompt_len=256, max_tokens_cap=CONTEXT - 256 - 1, early_stop_factor=2.0, warmup_requests=8,
                     interleave=True)


def calibrate(server: ServerSpec, client: ClientConfig, spec: BenchSpec, cache: DatasetCache,
              measure_step: bool) -> tuple[float | None, float]:
    """(lone-request decode step, fcfs saturation req/s over HTTP) on one fcfs server."""
    with running_server(server, "fcfs") as url:
        lc = LoadClient(dataclasses.replace(client, base_url=url))
        lc.run([dataclasses.replace(r, arrival_time=0.0) for r in spec.make(None, cache)[:8]])  # warm-up
        wait_idle(lc.cfg)
        step = lc.measure_decode_step() if measure_step else None
        burst = spec.make(None, cache)  # every request at t = 0
        m = summarize(lc.run(burst).records)
        if m["num_failed"]:
            raise RuntimeError(f"{m['num_failed']} requests failed in the saturation run")
        return step, m["throughput_rps"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="alpaca,sharegpt")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "scheduling" / "results"))
    ap.add_argument("--figures", default=str(ROOT / "benchmarks" / "scheduling" / "figures"))
    args = ap.parse_args()
    results_dir, figures_dir = Path(args.results), Path(args.figures)
    results_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)

    profile = results_dir / f"bench_http_sched_seed{args.seed}.profile.json"
    print(f"profile: {make_profile(profile):.0f} s -> {profile}", flush=True)
    server = ServerSpec(model=str(MODEL), threads=1, args=[
        "--dtype", "float32", "--max-batch-size", str(BATCH), "--profile", str(profile),
        "--kv-cache-blocks", str(args.num_requests * CONTEXT // 16)])  # ample: every request at once
    client = ClientConfig(base_url="", send_expected_length=True, prompt_format="synthetic")
    cache = DatasetCache()
    slo: float | None = None
    summary = []
    for workload in args.workloads.split(","):
        spec = spec_for(workload, args.num_requests, args.seed)
        step, sat = calibrate(server, client, spec, cache, measure_step=slo is None)
        if step is not None:
            slo = SLO_DECODE_FACTOR * step
            print(f"lone-request decode step over HTTP: {1e3 * step:.3f} ms -> SLO {slo:.5f} s/token", flush=True)
        assert slo is not None
        rates = [round(f * sat, 2) for f in FRACTIONS]
        print(f"{workload}: fcfs saturation over HTTP {sat:.2f} req/s; rates {rates}", flush=True)
        spec = dataclasses.replace(spec, rates=rates, slo=SLO(mean_normalized_latency=slo))
        t0 = time.perf_counter()
        results = run_bench(spec, client, server)
        results["summary"]["fcfs_saturation_rps"] = sat
        results["workload"]["rate_fractions"] = list(FRACTIONS)
        stem = f"bench_http_{workload}_n{args.num_requests}_seed{args.seed}"
        out = results_dir / f"{stem}.json"
        out.write_text(json.dumps(results, indent=1) + "\n")
        fig = plot_results([results], figures_dir / f"{stem}.png", [workload])
        print(format_summary([results], [workload]))
        print(format_table([results]))
        print(f"{workload}: {time.perf_counter() - t0:.0f} s; wrote {out} and {fig}", flush=True)
        summary.append((workload, sat, results["summary"]))

    print(f"\nSLO (mean normalized latency) {slo:.5f} s/token; N = {args.num_requests}, seed {args.seed}")
    print(f"{'workload':10} {'fcfs sat req/s':>14} " + " ".join(f"{p:>16}" for p in POLICIES) + "   ratios vs fcfs")
    for workload, sat, summ in summary:
        mr, cens = summ["max_rate_under_slo"], set(summ.get("max_rate_censored") or [])
        ratios = summ.get("max_rate_ratio_vs_fcfs") or {}
        cells = " ".join(f"{mr.get(p, float('nan')):15.2f}{'+' if p in cens else ' '}" for p in POLICIES)
        print(f"{workload:10} {sat:14.2f} {cells}   " + ", ".join(f"{p} {ratios[p]:.2f}" for p in POLICIES[1:]
                                                               if p in ratios))


if __name__ == "__main__":
    main()
