"""Decode step time with the decode fast paths off and on: tables rebuilt from every plan
(`--no-persistent-batch`), the persistent batch (default), with `--compile` (inductor), and
with `--dtype bfloat16` where the CPU has native bf16.

stories260k and a 24M Llama (hidden 512, 8 layers, vocab 512, built here with transformers),
fp32, one PyTorch thread, prompts of 32 tokens, 64 greedy tokens per request, batch 1 and 16.
Variants alternate round by round in one process each (machine drift hits all alike); reported:
the median over rounds of the mean decode-only step, and each variant's ratio to the rebuild
path. Compilation happens in a warm-up run and is reported apart (start-up cost).

    .venv/bin/python benchmarks/decode/decode_fastpath.py [--rounds 3] [--no-compile] \
        [--out benchmarks/decode/results/decode_fastpath.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from logprobs_overhead import decode_step_seconds
from tokenslice import LLM, SamplingParams
from tokenslice.predict.embed import resolve_embed_dtype

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260k"
PROMPT, NEW = 32, 64
VARIANTS = {"rebuild": dict(persistent_batch=False), "persistent": dict(persistent_batch=True),
            "compiled": dict(persistent_batch=True, compile=True),
            # Only where this CPU multiplies bf16 natively (AVX512-BF16 / AMX), as the length
            # predictor decides (predict/embed.py).
            "bf16": dict(persistent_batch=True, dtype="bfloat16")}


def build_24m(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, path / name)
    return path


def decode_step_s(llm: LLM, batch: int) -> float:
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    return decode_step_seconds(llm.engine, batch, sp, torch.randint(3, 500, (batch, PROMPT), generator=g).tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled variant")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    native_bf16 = resolve_embed_dtype("auto") == torch.bfloat16
    variants = {k: v for k, v in VARIANTS.items()
                if not (a.no_compile and v.get("compile")) and (native_bf16 or k != "bf16")}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, path in (("stories260k", STORIES), ("llama-24m", build_24m(Path(d)))):
            llms, startup = {}, {}
            for v, opts in variants.items():
                llms[v] = LLM(str(path), **{"dtype": "float32", **opts}, max_batch_size=max(batches),
                              kv_cache_blocks=256)
                t0 = time.perf_counter()
                for b in batches:  # warm-up; compiles every bucket the measured runs meet
                    decode_step_s(llms[v], b)
                startup[v] = time.perf_counter() - t0
            times: dict[tuple[str, int], list[float]] = {}
            for i in range(a.rounds):
                for v in (list(variants) if i % 2 == 0 else list(reversed(variants))):
                    for b in batches:
                        times.setdefault((v, b), []).append(decode_step_s(llms[v], b))
            for llm in llms.values():
                llm.close()
            for b in batches:
                base = statistics.median(times[("rebuild", b)])
                for v in variants:
                    ms = statistics.median(times[(v, b)])
                    rows.append({"model": name, "batch": b, "variant": v, "step_ms": 1e3 * ms,
                                 "vs_rebuild": ms / base, "warmup_s": startup[v],
                                 "all_ms": [1e3 * t for t in times[(v, b)]]})
                    print(f"{name:12s} batch {b:3d} {v:10s} {1e3 * ms:8.3f} ms/step  x{ms / base:5.2f}  "
                          f"(warm-up {startup[v]:.1f} s)", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"benchmark": "decode_fastpath", "rounds": a.rounds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
