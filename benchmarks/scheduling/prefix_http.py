"""Prefix caching on the real engine over HTTP: multi-turn ShareGPT conversations with priority
updates, caching on vs off, TTFT of the later turns (FastSwitch §3.3 / multi-turn KV reuse).

Two `tokenslice serve` child processes (../shared/models/stories260k, fp32, one PyTorch thread,
`--policy priority`, max batch 16, ample KV), one with `--enable-prefix-caching` (the default)
and one with `--no-enable-prefix-caching`; this process is the HTTP client (`LoadClient`), which
sends each conversation's turns one after another with the real answers in the history.

Rules fixed before any result was seen:
  * conversations: `sharegpt_multiturn_800.json`, tokenized with the model's own tokenizer, those
    with at least 2 turns, the first 4 turns of each; every human turn cut to its first 48 tokens
    (the kept ids decoded back to text), answers 32 tokens (max_tokens + ignore_eos), so a
    4-turn history fits the model's 512-token context;
  * N = 120 conversations, Poisson arrivals at 4 conversations/s, seed 0;
  * priorities: the Markov pattern, 8 levels, updated every 50 iterations (f = 0.02) of the lone
    request's decode step measured on the first server, through the priority route;
  * runs alternate on, off, off, on on the same trace (drift on this shared box hits both alike);
    the metric is the p50 TTFT of turns >= 2, pooled over each variant's two runs.

    .venv/bin/python benchmarks/scheduling/prefix_http.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from tokenslice.bench.client import LoadClient
from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.server_counters import wait_idle
from tokenslice.bench.sweep import ServerSpec, running_server
from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.priority_patterns import PriorityPattern
from tokenslice.bench.workloads import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "stories260k"
TURNS, PROMPT_TOKENS, ANSWER_TOKENS = 4, 48, 32
VARIANTS = {"on": "--enable-prefix-caching", "off": "--no-enable-prefix-caching"}
ORDER = ("on", "off", "off", "on")


def conversations(n: int, rate: float, seed: int) -> tuple[list[WorkloadRequest], dict[str, list[WorkloadRequest]]]:
    """First turns (with arrival times) and each conversation's later turns."""
    cache = DatasetCache()
    tok = cache.tokenizer(MODEL)
    convs = [c for c in cache.conversation_records(SHARED / "data" / "sharegpt_multiturn_800.json", MODEL)
             if len(c) >= 2][:n]
    arrivals = arrival_times(len(convs), rate, 1.0, np.random.default_rng(seed))
    firsts, later = [], {}
    for conv, t in zip(convs, arrivals, strict=True):
        cid = str(conv[0].conversation_id)
        turns = []
        for rec in conv[:TURNS]:
            ids = list(rec.prompt_token_ids[:PROMPT_TOKENS]) or [tok.eos_token_id or 0]
            turns.append(WorkloadRequest(request_id=f"{cid}-turn{rec.turn}", arrival_time=float(t),
                                         prompt=tok.decode(ids), prompt_len=len(ids), output_len=ANSWER_TOKENS,
                                         conversation_id=cid, turn=rec.turn))
        firsts.append(turns[0])
        later[cid] = turns[1:]
    return firsts, later


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-conversations", type=int, default=120)
    ap.add_argument("--rate", type=float, default=4.0, help="conversations per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "scheduling" / "results" / "prefix_http_n120_seed0.json"))
    args = ap.parse_args()
    firsts, later = conversations(args.num_conversations, args.rate, args.seed)
    pattern = PriorityPattern("markov", update_freq=0.02, levels=8, seed=args.seed)
    blocks = str(args.num_conversations * 512 // 16)
    base = ["--dtype", "float32", "--policy", "priority", "--max-batch-size", "16", "--kv-cache-blocks", blocks]
    client = ClientConfig(base_url="", prompt_format="auto")
    step_s: float | None = None
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    runs = []
    for variant in ORDER:
        spec = ServerSpec(model=str(MODEL), threads=1, args=[*base, VARIANTS[variant]])
        with running_server(spec, "priority") as url:
            lc = LoadClient(dataclasses.replace(client, base_url=url))
            lc.run([WorkloadRequest(f"warm-{i}", 0.0, None, PROMPT_TOKENS, ANSWER_TOKENS) for i in range(8)])
            wait_idle(lc.cfg)
            if step_s is None:
                step_s = lc.measure_decode_step()
            result = lc.run(firsts, later, priority=pattern, iteration_s=step_s)
            counters = result.server_counters
        failed = [r for r in result.records if not r.ok]
        if failed:
            raise RuntimeError(f"{variant}: {len(failed)} turns failed, e.g. {failed[0].error}")
        later_ttft = [r.ttft for r in result.records if r.turn >= 1 and r.ttft is not None]
        ttft[variant] += later_ttft
        hits = {k: v for k, v in counters.items() if "prefix_cache" in k}
        runs.append({"variant": variant, "p50_ttft_later_turns": float(np.median(later_ttft)),
                     "p50_ttft_first_turns": float(np.median([r.ttft for r in result.records if r.turn == 0])),
                     "turns": len(result.records), "prefix_cache_counters": hits,
                     "priority_updates": result.priority_updates})
        print(f"{variant:>3}: {len(result.records)} turns, p50 TTFT turns >= 2 {1e3 * runs[-1]['p50_ttft_later_turns']:.2f} ms, "
              f"first turns {1e3 * runs[-1]['p50_ttft_first_turns']:.2f} ms; {hits}", flush=True)
    p50 = {v: float(np.median(x)) for v, x in ttft.items()}
    print(f"\nN = {args.num_conversations} conversations ({TURNS} turns, {PROMPT_TOKENS}-token prompts, "
          f"{ANSWER_TOKENS}-token answers) at {args.rate}/s, seed {args.seed}; decode step {1e3 * (step_s or 0):.2f} ms")
    print(f"p50 TTFT of turns >= 2: caching on {1e3 * p50['on']:.2f} ms, off {1e3 * p50['off']:.2f} ms, "
          f"off / on = {p50['off'] / p50['on']:.2f} (target >= 2)")
    Path(args.out).write_text(json.dumps({"runs": runs, "p50_ttft_later_turns": p50, "decode_step_s": step_s,
                                          "args": vars(args)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
