"""How much of the engine's capacity survives HTTP: `tokenslice serve` with the engine core in its
own process (the default) and with the engine on a thread of the server (`--no-engine-process`),
against the same engine in this process (`LLM.generate`), on the same requests.

Setup, fixed before any result was seen:
  * ../shared/models/stories260k, fp32, max batch 16, 512 KV blocks (no preemption), fcfs;
    one PyTorch thread in every process that runs the model (OMP_NUM_THREADS=1 for the servers,
    torch.set_num_threads(1) here);
  * N = 300 requests, seed 0: prompts of 8-120 token ids, outputs of 8-200 tokens (max_tokens
    with ignore_eos), greedy; the HTTP client streams (`tokenslice.bench.client.LoadClient`);
  * saturation: every request at t = 0; throughput = finished requests / makespan. Runs are
    interleaved engine, split server, thread server, repeated `--pairs` times; the ratio is each
    server's throughput over the engine's in the same round;
  * latency: Poisson arrivals at `--load` x the median in-process throughput, same requests,
    mean TTFT and p99 TBT as the client sees them, split and thread servers alternating.

    .venv/bin/python benchmarks/serving/http_vs_engine.py --out benchmarks/serving/results/http_vs_engine.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenslice import LLM, SamplingParams
from tokenslice.bench.client import LoadClient
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.request_stream import synthetic_prompt_ids
from tokenslice.bench.server_counters import wait_idle
from tokenslice.bench.metrics import summarize
from tokenslice.bench.sweep import ServerSpec, running_server
from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.workloads import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT.parent / "shared" / "models" / "stories260k"
MAX_BATCH, KV_BLOCKS = 16, 512
SERVERS = {"split": "--engine-process", "thread": "--no-engine-process"}


def workload(n: int, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(8, 121, size=n)
    output_lens = rng.integers(8, 201, size=n)
    return [WorkloadRequest(request_id=f"r{i}", arrival_time=0.0, prompt=None, prompt_len=int(p), output_len=int(o),
                            prompt_token_ids=synthetic_prompt_ids(int(p), i))
            for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True))]


def engine_rps(llm: LLM, reqs: list[WorkloadRequest]) -> float:
    prompts = [list(r.prompt_token_ids or []) for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [r.output_len for r in reqs]
    return len(reqs) / wall


def http_run(url: str, reqs: list[WorkloadRequest]) -> dict[str, Any]:
    cfg = ClientConfig(url, prompt_format="auto", request_timeout_s=600.0)
    result = LoadClient(cfg).run(reqs)
    m = summarize(result.records)
    if m["num_failed"]:
        raise RuntimeError(f"{m['num_failed']} requests failed against {url}")
    wait_idle(cfg)
    return {k: m[k] for k in ("throughput_rps", "mean_ttft", "p99_tbt", "num_finished")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=3, help="interleaved rounds of each measurement")
    ap.add_argument("--load", type=float, default=0.7, help="Poisson rate as a fraction of in-process throughput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reqs = workload(args.num_requests, args.seed)
    common = ["--dtype", "float32", "--max-batch-size", str(MAX_BATCH), "--kv-cache-blocks", str(KV_BLOCKS)]
    llm = LLM(str(MODEL), dtype="float32", max_batch_size=MAX_BATCH, kv_cache_blocks=KV_BLOCKS)
    engine_rps(llm, reqs[:32])  # warm-up
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        urls = {name: stack.enter_context(running_server(ServerSpec(str(MODEL), [*common, flag], threads=1), "fcfs"))
                for name, flag in SERVERS.items()}
        for url in urls.values():
            http_run(url, reqs[:32])  # warm-up
        for i in range(args.pairs):
            base = engine_rps(llm, reqs)
            rows.append({"round": i, "run": "saturation", "server": "engine", "throughput_rps": base})
            for name, url in urls.items():
                m = http_run(url, reqs)
                rows.append({"round": i, "run": "saturation", "server": name, **m,
                             "ratio": m["throughput_rps"] / base})
        rate = args.load * statistics.median(r["throughput_rps"] for r in rows if r["server"] == "engine")
        times = arrival_times(len(reqs), rate, 1.0, np.random.default_rng(args.seed))
        poisson = [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(reqs, times, strict=True)]
        for i in range(args.pairs):
            for name, url in (urls.items() if i % 2 == 0 else reversed(urls.items())):
                rows.append({"round": i, "run": f"poisson {rate:.1f}/s", "server": name, **http_run(url, poisson)})
    print(f"{'run':<16} {'round':>5} {'server':<7} {'req/s':>7} {'/engine':>8} {'mean TTFT ms':>13} {'p99 TBT ms':>11}")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        ttft = f"{1e3 * r['mean_ttft']:.1f}" if r.get("mean_ttft") is not None else ""
        tbt = f"{1e3 * r['p99_tbt']:.1f}" if r.get("p99_tbt") is not None else ""
        print(f"{r['run']:<16} {r['round']:>5} {r['server']:<7} {r['throughput_rps']:>7.2f} {ratio:>8} {ttft:>13} {tbt:>11}")
    if args.out:
        Path(args.out).write_text(json.dumps({"num_requests": args.num_requests, "seed": args.seed, "load": args.load,
                                              "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
