"""FastSwitch's evaluation (§4, Fig. 8 ablation) on the simulator: priority scheduling with
changing priorities on multi-turn chat, vLLM's swapping vs FastSwitch's three parts.

Protocol, fixed before any run:

- Profiles llama-8b@a10-24gb and qwen-32b@a100-80gb. Device KV pool: what the cost model leaves
  beside the weights (`kv_capacity_tokens()`, 90% of GPU memory) in blocks of 16 tokens; host
  tier 60 GB in blocks of 16 tokens x the profile's KV bytes per token.
- Workload: the first N = 300 conversations of sharegpt_multiturn_800.json (GPT-2 tokens), as
  closed-loop sessions (benchmarks/scheduling/multiturn.py): each turn's prompt is the whole history, the
  model answers with the recorded answer (<= 512 tokens), a conversation ends at the first turn
  that would pass 4096 tokens. Conversations start by Poisson at 1 / (mean turns per
  conversation) per second, so turns arrive at ~1 req/s; a later turn comes 10 s after the
  previous answer. Seed 0 for arrivals and priorities.
- Scheduler: policy `priority` (lower level first, vLLM's priority scheduling), 8 levels, batch
  256 (vLLM's max_num_seqs), other settings at their defaults. Priority patterns Markov and
  Random (FastSwitch §4) at update frequencies 0.02 and 0.04 (every 50 / 25 steps).
- Variants, in Fig. 8's order: baseline = vLLM (reactive-swap: synchronous swaps,
  --no-block-groups: one copy per block, --no-enable-prefix-caching: no host copies kept);
  +groups (block groups); +reuse (prefix caching on: a request swapped out again copies only
  what its host copy lacks, later turns reuse cached KV); +async = full FastSwitch
  (proactive-swap: swaps overlap compute); +guard = full FastSwitch with the stall guard on
  (docs/DESIGN.md: a 10 tokens/s reader's timeline and --max-stall-ms 250), compared with the
  baseline on the same tails (the stall issue's check: P99.9 TBT >= 3x better).
- Reported per (profile, pattern, freq, variant): P95/P99/P99.9 TTFT over all turns, P99.9 TBT
  over every inter-token gap, swap-out blocks (and, with prefix caching, cached blocks offloaded
  to host when evicted from device: device->host traffic too), copy operations (both directions,
  prefix-cache loads from host included), preemptions,
  output-token throughput; and baseline/full ratios (tails) and cuts (swap-out blocks, copies).
- Memory-bound variant: the same runs with a quarter of each profile's device pool, run in
  any case and labelled as such: at 1 req/s the full pools may not bind, and without memory
  pressure nothing swaps and the variants cannot differ.

Targets (from the brief): every tail metric >= 1.5x better than the baseline, P99.9 TBT >= 3x,
swap-out blocks cut >= 50%. FastSwitch reports 1.4-5.8x TTFT tails, 2.0-11.2x P99.9 TBT and 53%
less swap-out volume.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/scheduling/fastswitch_sim.py [--conversations 300]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.priority_patterns import PriorityPattern, PriorityUpdates
from tokenslice.config import SchedulerConfig
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.executor import offload_block_bytes
from tokenslice.predict.cost import load_cost_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from multiturn import Turn, play_sessions, sessions  # noqa: E402
from sched_common import code_version  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROFILES = ("llama-8b@a10-24gb", "qwen-32b@a100-80gb")
BLOCK = 16
HOST_BYTES = 60e9
CONTEXT = 4096
THINK_S = 10.0
TURN_RATE = 1.0  # turns per second
MAX_BATCH = 256
PATTERNS = ("markov", "random")
FREQS = (0.02, 0.04)
MEMORY_BOUND_SHARE = 4  # the memory-bound variant's device pool: 1/4 of the profile's


@dataclass(frozen=True)
class Variant:
    name: str
    preemption: str
    block_groups: bool
    prefix_caching: bool
    stall_guard: str = "off"  # docs/DESIGN.md, Stall guard: a 10 tokens/s reader's timeline ...
    max_stall_ms: float | None = None  # ... and a hard bound on the gap between two tokens


GUARD_MAX_STALL_MS = 250.0
VARIANTS = (Variant("baseline", "reactive-swap", False, False), Variant("+groups", "reactive-swap", True, False),
            Variant("+reuse", "reactive-swap", True, True), Variant("+async", "proactive-swap", True, True),
            Variant("+guard", "proactive-swap", True, True, "on", GUARD_MAX_STALL_MS))
TAILS = ("p95_ttft", "p99_ttft", "p999_ttft", "p999_tbt")


def run_one(convs: list[list[Turn]], profile: str, kv_blocks: int, host_blocks: int, conv_rate: float,
            pattern: str, freq: float, v: Variant, seed: int) -> dict[str, Any]:
    cost = load_cost_model(profile)
    cfg = SchedulerConfig(policy="priority", preemption=v.preemption, max_batch_size=MAX_BATCH,
                          stall_guard=v.stall_guard, max_stall_ms=v.max_stall_ms)
    eng = simulated_engine(cfg, cost, kv_cache_blocks=kv_blocks, block_size=BLOCK, host_kv_blocks=host_blocks,
                           max_model_len=CONTEXT, enable_prefix_caching=v.prefix_caching, block_groups=v.block_groups)
    updates = PriorityUpdates(PriorityPattern(pattern, freq, seed=seed))
    r = play_sessions(eng, convs, conv_rate, THINK_S, seed, updates)
    ttft = np.array([q.metrics.ttft for q in r.requests])
    tbt = np.concatenate([np.diff(q.metrics.token_times) for q in r.requests])
    start = min(q.metrics.arrival_time for q in r.requests)
    span = max(q.metrics.finish_time for q in r.requests) - start
    s = eng.scheduler.stats
    block_bytes = offload_block_bytes(BLOCK, cost.kv_bytes_per_token)
    q = lambda a, p: float(np.quantile(a, p))  # noqa: E731
    return {"turns": len(r.requests), "p95_ttft": q(ttft, 0.95), "p99_ttft": q(ttft, 0.99),
            "p999_ttft": q(ttft, 0.999), "p999_tbt": q(tbt, 0.999), "swap_out_blocks": s.swap_out_bytes // block_bytes,
            "offload_blocks": s.prefix_cache_offload_bytes // block_bytes,
            "swap_in_blocks": s.swap_in_bytes // block_bytes, "swap_ops": s.swap_ops, "preemptions": s.preemptions,
            "swap_fallbacks": s.swap_fallbacks, "recomputed_tokens": s.recomputed_tokens,
            "throughput_tok_s": float(sum(q.num_output_tokens for q in r.requests) / span),
            "kv_peak_fraction": eng.scheduler.kv.device.peak_used / kv_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated priority patterns to run")
    ap.add_argument("--freqs", default=",".join(map(str, FREQS)), help="comma-separated update frequencies to run")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                    help="comma-separated variants to run (baseline and +async or +guard give the ratios)")
    a = ap.parse_args()
    t0 = time.time()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    convs = sessions(a.conversations, CONTEXT)
    turns = sum(len(c) for c in convs)
    conv_rate = TURN_RATE * len(convs) / turns
    say(f"{len(convs)} conversations, {turns} turns (mean {turns / len(convs):.2f}); conversations start at "
        f"{conv_rate:.3f}/s (turns ~{TURN_RATE}/s), think {THINK_S}s, context {CONTEXT}; policy priority, "
        f"batch {MAX_BATCH}, seed {a.seed}; machine: this 2-core CPU box, simulator (virtual time)")
    out: dict[str, Any] = {"protocol": {"conversations": len(convs), "turns": turns, "conv_rate": conv_rate,
                                        "think_s": THINK_S, "context": CONTEXT, "max_batch_size": MAX_BATCH,
                                        "seed": a.seed, "host_bytes": HOST_BYTES}, "code": code_version(),
                           "settings": []}
    for setting, share in (("full pool", 1), ("memory-bound variant (1/4 pool)", MEMORY_BOUND_SHARE)):
        for profile in PROFILES:
            cost = load_cost_model(profile)
            kv_blocks = cost.kv_capacity_tokens() // BLOCK // share
            host_blocks = int(HOST_BYTES // (BLOCK * cost.kv_bytes_per_token))
            say(f"\n== {setting}: {profile}, device {kv_blocks} blocks ({kv_blocks * BLOCK} tokens), "
                f"host {host_blocks} blocks (60 GB)")
            say(f"{'pattern':7s} {'freq':>5s} {'variant':9s} {'p95_ttft':>9s} {'p99_ttft':>9s} {'p999_ttft':>9s} "
                f"{'p999_tbt':>9s} {'swap_out_blk':>12s} {'offload_blk':>11s} {'copies':>8s} {'preempt':>7s} {'tok/s':>7s} {'kv_peak':>7s}")
            for pattern in a.patterns.split(","):
                for freq in [float(f) for f in a.freqs.split(",")]:
                    cell: dict[str, Any] = {"setting": setting, "profile": profile, "kv_blocks": kv_blocks,
                                            "host_blocks": host_blocks, "pattern": pattern, "freq": freq,
                                            "variants": {}}
                    for v in [v for v in VARIANTS if v.name in a.variants.split(",")]:
                        m = run_one(convs, profile, kv_blocks, host_blocks, conv_rate, pattern, freq, v, a.seed)
                        cell["variants"][v.name] = m
                        say(f"{pattern:7s} {freq:5.2f} {v.name:9s} {m['p95_ttft']:9.3f} {m['p99_ttft']:9.3f} "
                            f"{m['p999_ttft']:9.3f} {m['p999_tbt']:9.4f} {m['swap_out_blocks']:12d} "
                            f"{m['offload_blocks']:11d} {m['swap_ops']:8d} {m['preemptions']:7d} {m['throughput_tok_s']:7.1f} "
                            f"{m['kv_peak_fraction']:7.2f}")
                    out["settings"].append(cell)
                    ran = cell["variants"]
                    base = ran.get("baseline")
                    if base is not None and "+async" in ran:
                        full = ran["+async"]
                        ratio = {k: base[k] / full[k] if full[k] > 0 else None for k in TAILS}
                        cut = {k: 1 - full[k] / base[k] if base[k] > 0 else None for k in ("swap_out_blocks", "swap_ops")}
                        cell["baseline_over_full"], cell["cut"] = ratio, cut
                        say(f"{'':14s}baseline/full: " + "  ".join(f"{k} {_x(ratio[k])}" for k in TAILS)
                            + "  | cut: " + "  ".join(f"{k} {_pct(cut[k])}" for k in cut))
                    if base is not None and "+guard" in ran:
                        guard = ran["+guard"]
                        cell["baseline_over_guard"] = {k: base[k] / guard[k] if guard[k] > 0 else None for k in TAILS}
                        say(f"{'':14s}baseline/+guard: "
                            + "  ".join(f"{k} {_x(cell['baseline_over_guard'][k])}" for k in TAILS))
    say(f"\nwall {time.time() - t0:.0f}s")
    name = f"fastswitch_sim_n{a.conversations}_seed{a.seed}"
    if a.variants != ",".join(v.name for v in VARIANTS):
        name += "_" + a.variants.replace(",", "_").replace("+", "")
    if a.patterns != ",".join(PATTERNS) or a.freqs != ",".join(map(str, FREQS)):
        name += "_" + a.patterns.replace(",", "_") + "_" + a.freqs.replace(",", "_")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / f"{name}.txt").write_text("\n".join(lines) + "\n")


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "n/a (no swaps)" if v is None else f"{100 * v:.0f}%"


if __name__ == "__main__":
    main()
