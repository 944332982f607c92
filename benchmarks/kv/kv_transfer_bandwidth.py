"""KV swap bandwidth: the runner's host<->device block copies against a plain memcpy.

KV of the 56M Llama of benchmarks/common/llama56m.py (8 layers, 4 KV heads, head_dim 64, fp32,
block_size 16: 256 KiB per block across all layers), device and host pools of 1024 blocks, 256
blocks (64 MiB) moved per swap. On a CPU-only machine both tiers are host memory: "device" is
the runner's KV tensor, "host" its host-tier tensor, so this measures the copy machinery (op
count, access pattern), not a PCIe link.

Fragmentation patterns: the 256 blocks as 1 run (a block group), runs of 16, runs of 4, and
256 scattered single blocks (source and destination both at random places). Methods:
* per-block-per-layer: one copy per block per layer per K/V (2 x 8 x 256 = 4096 ops);
* per-run (what ModelRunner.swap does): one strided copy per contiguous run, all layers;
* batched gather: one index_select over all layers into a preallocated staging buffer, then one
  index_copy_ (2 ops, but every byte moves twice).
Plus int8 offload (ALISE §3.2, runner with offload_dtype="int8": quantize + copy out, copy +
dequantize in) against full precision. GB/s counts the full-precision KV bytes moved once. Each method is timed alternately with the
memcpy, best of the reps for both (medians are in the JSON).

    flock /tmp/tokenslice-bench.lock .venv/bin/python benchmarks/kv/kv_transfer_bandwidth.py \
        [--threads 1,2] [--out benchmarks/kv/results/kv_transfer_bandwidth.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tokenslice.model.arch import parse_config
from tokenslice.model.loader import LoadedModel
from tokenslice.model.runner import ModelRunner
from tokenslice.plan import copy_runs

LLAMA_56M = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512,
             "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
             "intermediate_size": 1376, "max_position_embeddings": 2048}
BLOCK_SIZE, POOL, MOVE = 16, 1024, 256
PATTERNS = {"1 run": MOVE, "runs of 16": 16, "runs of 4": 4, "scattered": 1}


def runner(offload_dtype: str = "auto") -> ModelRunner:
    """A runner with real KV tensors; swaps need no weights, so the model is a stand-in."""
    loaded = LoadedModel(nn.Identity(), parse_config(LLAMA_56M), None, torch.float32, torch.device("cpu"),
                         "llama-56m-kv")
    r = ModelRunner(loaded, POOL, BLOCK_SIZE, num_host_blocks=POOL, offload_dtype=offload_dtype)
    r.kv.normal_()
    for h in r.host:
        h.zero_()  # fault the pages in now, not inside the first timed copy
    return r


def pairs_for(run_len: int, seed: int) -> list[tuple[int, int]]:
    """MOVE (source, destination) pairs in runs of run_len at random aligned places on both sides."""
    rng = random.Random(seed)
    n_runs = MOVE // run_len
    src = rng.sample(range(POOL // run_len), n_runs)
    dst = rng.sample(range(POOL // run_len), n_runs)
    return [(s * run_len + i, d * run_len + i) for s, d in zip(src, dst) for i in range(run_len)]


def _once(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Paired:
    """Times a method against the plain memcpy, interleaved rep by rep, and keeps the best of
    each: on this shared 2-core machine other processes come and go and halve the memory
    bandwidth now and then; the best times are the uncontended ones of both."""

    def __init__(self, nbytes: int) -> None:
        self.a = torch.randn(nbytes // 4)
        self.b = torch.zeros_like(self.a)

    def memcpy(self) -> None:
        self.b.copy_(self.a)

    def __call__(self, fn: Callable[[], object], reps: int) -> tuple[float, float, float, float]:
        """(best seconds of fn, best seconds of memcpy, median seconds of fn, of memcpy)."""
        fn()
        self.memcpy()
        pairs = [(_once(fn), _once(self.memcpy)) for _ in range(reps)]
        f, m = [p[0] for p in pairs], [p[1] for p in pairs]
        return min(f), min(m), statistics.median(f), statistics.median(m)


def per_block_per_layer(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
    for s, d in pairs:
        for layer in range(src.shape[0]):
            for kv in range(2):
                dst[layer, kv, d].copy_(src[layer, kv, s])
    return len(pairs) * src.shape[0] * 2


class Gather:
    """One flat index_select over every (layer, k/v, block) row + one index_copy_."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        lkv = src.shape[0] * 2
        self.src = src.view(lkv * src.shape[2], -1)
        self.dst = dst.view(lkv * dst.shape[2], -1)
        s, d = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
        self.src_rows = (torch.arange(lkv)[:, None] * src.shape[2] + s).flatten()
        self.dst_rows = (torch.arange(lkv)[:, None] * dst.shape[2] + d).flatten()
        self.staging = torch.empty(len(self.src_rows), self.src.shape[1], dtype=src.dtype)
        self.staging.zero_()

    def __call__(self) -> int:
        torch.index_select(self.src, 0, self.src_rows, out=self.staging)
        self.dst.index_copy_(0, self.dst_rows, self.staging)
        return 2


def measure(threads: int, reps: int) -> dict[str, object]:
    torch.set_num_threads(threads)
    full, int8 = runner(), runner("int8")
    nbytes = MOVE * full.block_bytes
    paired = Paired(nbytes)
    rows: list[dict[str, object]] = []

    def row(name: str, n_runs: int, direction: str, method: str, ops: int, fn: Callable[[], object],
            n: int, **extra: object) -> None:
        s, mem_s, med_s, med_mem_s = paired(fn, n)
        rows.append({"pattern": name, "runs": n_runs, "direction": direction, "method": method, "ops": ops,
                     "ms": 1e3 * s, "GBps": nbytes / s / 1e9, "memcpy_ms": 1e3 * mem_s,
                     "share_of_memcpy": mem_s / s, "median_ms": 1e3 * med_s, "median_memcpy_ms": 1e3 * med_mem_s,
                     **extra})

    for name, run_len in PATTERNS.items():
        pairs = pairs_for(run_len, seed=run_len)
        back = [(d, s) for s, d in pairs]
        n_runs = len(copy_runs(pairs))
        host = full.host[0]
        for direction, dst, src, prs in (("out", host, full.kv, pairs), ("in", full.kv, host, back)):
            ops0 = full.copy_calls
            full.swap(prs, direction)
            row(name, n_runs, direction, "per-block-per-layer", MOVE * 2 * 8,
                lambda: per_block_per_layer(dst, src, prs), max(3, reps // 3))
            row(name, n_runs, direction, "per-run", full.copy_calls - ops0, lambda: full.swap(prs, direction), reps)
            row(name, n_runs, direction, "batched gather", 2, Gather(dst, src, prs), reps)
        for direction, prs in (("out", pairs), ("in", back)):
            row(name, n_runs, direction, "int8 per-run", 3 * n_runs, lambda: int8.swap(prs, direction),
                max(3, reps // 2), bytes_moved=MOVE * int8.host_block_bytes)
    mem = min(r["memcpy_ms"] for r in rows)  # type: ignore[type-var]
    return {"threads": threads, "bytes": nbytes, "memcpy_ms": mem, "memcpy_GBps": nbytes / mem / 1e6,
            "int8_bytes_per_block": int8.host_block_bytes, "full_bytes_per_block": full.block_bytes, "rows": rows}


def report(res: dict[str, object]) -> None:
    print(f"\n{res['threads']} thread(s): {res['bytes'] / 2**20:.0f} MiB per swap; best plain memcpy "
          f"{res['memcpy_ms']:.2f} ms = {res['memcpy_GBps']:.1f} GB/s; times are the best of the reps, "
          f"'of memcpy' = best memcpy time of the same (interleaved) reps / best method time")
    print(f"{'pattern':<11} {'runs':>4} {'dir':>3} {'method':<20} {'ops':>5} {'ms':>8} {'GB/s':>6} {'of memcpy':>9}"
          f" {'memcpy ms':>9} {'median ms':>9}")
    for r in res["rows"]:  # type: ignore[union-attr]
        print(f"{r['pattern']:<11} {r['runs']:>4} {r['direction']:>3} {r['method']:<20} {r['ops']:>5} "
              f"{r['ms']:>8.2f} {r['GBps']:>6.1f} {100 * r['share_of_memcpy']:>8.0f}% {r['memcpy_ms']:>9.2f} {r['median_ms']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for t in (int(x) for x in args.threads.split(",")):
        res = measure(t, args.reps)
        report(res)
        results.append(res)
    meta = {"date": "2026-11-22", "machine": f"{platform.processor() or platform.machine()}, 2-core CPU, no GPU",
            "torch": torch.__version__, "model_kv": "llama-56m: 8 layers, 4 kv heads, head_dim 64, fp32",
            "block_size": BLOCK_SIZE, "pool_blocks": POOL, "moved_blocks": MOVE}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
