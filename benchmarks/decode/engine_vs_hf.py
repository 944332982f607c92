"""Engine speed: decode tokens/s of tokenslice vs transformers' static-batch generate.

The 56M-parameter Llama of benchmarks/common/llama56m.py (hidden 512, 8 layers, 8 heads, 4 KV
heads, intermediate 1376, vocab 32000), fp32 on this machine's CPU, 64 prompt + 64 generated tokens
per request, batch 1, 16 and 64, all in one run. Also reports the per-step scheduler and
batch-preparation share at the largest batch, and the machine's measured roofline.

    .venv/bin/python benchmarks/decode/engine_vs_hf.py [--batches 1,16,64] \
        [--out benchmarks/decode/results/engine_vs_hf.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from tokenslice import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import NEW, PROMPT, build_checkpoint, prompts  # noqa: E402


def hf_decode_tok_s(model: LlamaForCausalLM, batch: int) -> float:
    ids = prompts(batch)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    prefill = min(run(1) for _ in range(2))
    full = run(NEW)
    return batch * (NEW - 1) / (full - prefill)


def ours_decode_tok_s(llm: LLM, batch: int) -> dict[str, float]:
    eng = llm.engine
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    llm.generate(prompts(min(batch, 4)).tolist(), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for p in prompts(batch).tolist():
        eng.add_request(p, sp)
    decode_s = overhead_s = 0.0
    decode_tokens = steps = 0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        sched0, upd0, prep0 = eng.timings.schedule_s, eng.timings.update_s, eng.runner.prep_seconds
        plan_is_decode = all(r.num_computed_tokens > 0 for r in eng.scheduler.requests.values())
        n = len(eng.scheduler.requests)
        eng.step()
        dt = time.perf_counter() - t0
        if plan_is_decode:
            decode_s += dt
            decode_tokens += n
            steps += 1
            overhead_s += (eng.timings.schedule_s - sched0) + (eng.timings.update_s - upd0) + (
                eng.runner.prep_seconds - prep0)
    return {"tok_s": decode_tokens / decode_s, "step_ms": 1000 * decode_s / steps,
            "overhead_share": overhead_s / decode_s}


def roofline() -> dict[str, float]:
    a = torch.randn(64 * 1024 * 1024 // 4)  # 64 MiB, beyond the caches
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    copy_bw = 10 * 2 * a.numel() * 4 / (time.perf_counter() - t)  # read + write
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x @ w
    t = time.perf_counter()
    for _ in range(20):
        x @ w
    flops = 20 * 2 * 1024 ** 3 / (time.perf_counter() - t)
    return {"memory_bandwidth_GBs": copy_bw / 1e9, "matmul_GFLOPs": flops / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(Path(d))
        hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        llm = LLM(d, dtype="float32", max_batch_size=max(batches), max_tokens_per_step=max(batches) * PROMPT,
                  kv_cache_blocks=max(batches) * (PROMPT + NEW) // 16 + 8)
        roof = roofline()
        rows = []
        for b in batches:
            theirs = hf_decode_tok_s(hf, b)
            ours = ours_decode_tok_s(llm, b)
            rows.append({"batch": b, "hf_tok_s": theirs, "tokenslice_tok_s": ours["tok_s"],
                         "ratio": ours["tok_s"] / theirs, "step_ms": ours["step_ms"],
                         "overhead_share": ours["overhead_share"]})
    weight_bytes = params * 4
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; model {params / 1e6:.1f}M params fp32")
    print(f"roofline: memory {roof['memory_bandwidth_GBs']:.1f} GB/s, matmul {roof['matmul_GFLOPs']:.1f} GFLOP/s")
    print(f"{'batch':>5} {'hf tok/s':>10} {'ours tok/s':>11} {'ratio':>6} {'step ms':>8} {'sched+prep':>10} "
          f"{'roofline step ms':>17}")
    for r in rows:
        # A decode step must read every weight once, and do 2 FLOPs per weight per sequence.
        bound = max(weight_bytes / (roof["memory_bandwidth_GBs"] * 1e9), 2 * params * r["batch"] / (roof["matmul_GFLOPs"] * 1e9))
        r["roofline_step_ms"] = 1000 * bound
        print(f"{r['batch']:>5} {r['hf_tok_s']:>10.1f} {r['tokenslice_tok_s']:>11.1f} {r['ratio']:>6.2f} "
              f"{r['step_ms']:>8.1f} {100 * r['overhead_share']:>9.1f}% {r['roofline_step_ms']:>17.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"roofline": roof, "params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
