"""Weight-only quantized linears (tokenslice/model/quant.py) against float GEMMs on SmolLM2-135M's
shapes: per shape, rows (1, 4, 8, 16) and threads (1, 2), the time of one call and the weight
bytes it reads per second; and the sum over one decode step's linears (30 layers of fused qkv, o,
fused gate_up, down, and the 49152-row head): the time a step spends in its linears.

Each layer shape is timed over 30 distinct copies of its weight (one per layer), called in turn,
so the caches see a step's working set; the head over its one copy. Best of --reps passes.
Variants: f32 `x @ W.T` (nn.Linear), f32 `x @ W_t` (InputMajorLinear, today's CPU path, without
its oneDNN copy), bf16 `x @ W.T` (QuantizedLinear's copy for DENSE_MIN_ROWS rows and more), and
the int8 and int4 kernels (QuantizedLinear without that copy; bf16 activations converted in and
out). The step sums add int8 / int4 as QuantizedLinear runs them (kernel or bf16 copy by row
count) and `auto`, SmolLM2's GGUF as loaded (Q4_1 layers as int4, the Q8_0 head as int8).
Also: the kernels with float32 activations (their reference path, why quant.py converts to
bf16), the quantization error on Gaussian weights, and GGUF's Q8_0 requantized to per-row int8
(on Gaussian weights, and on SmolLM2's real embedding where its package is installed). The timed
part holds /tmp/tokenslice-bench.lock.

    PYTHONPATH=. .venv/bin/python benchmarks/decode/quant_matmul.py [--reps 7] [--threads 1,2] [--quick]

Two threads on the 2-core development box are only meaningful while nothing else runs there:
next to a busy process OpenMP's barriers stall (BENCHMARKS.md's note on CPU timing).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import fcntl
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tokenslice.model.arch import ModelLoadError
from tokenslice.model.known_models import known_model, known_model_path
from tokenslice.model.layers import InputMajorLinear
from tokenslice.model.quant import DENSE_MIN_ROWS, GROUP_SIZE, QuantizedLinear, dequantize_int8, quantize_int8

HERE = Path(__file__).resolve().parent
LOCK = "/tmp/tokenslice-bench.lock"
LAYERS = 30
HIDDEN, KV, FFN, VOCAB = 576, 192, 1536, 49152
# name: (out N, in K, calls per decode step as the fused model runs: 0 for the parts fuse() joins)
SHAPES = {
    "q_proj": (HIDDEN, HIDDEN, 0), "k_proj": (KV, HIDDEN, 0), "v_proj": (KV, HIDDEN, 0),
    "o_proj": (HIDDEN, HIDDEN, LAYERS), "gate_proj": (FFN, HIDDEN, 0), "up_proj": (FFN, HIDDEN, 0),
    "down_proj": (HIDDEN, FFN, LAYERS), "qkv_proj": (HIDDEN + 2 * KV, HIDDEN, LAYERS),
    "gate_up_proj": (2 * FFN, HIDDEN, LAYERS), "lm_head": (VOCAB, HIDDEN, 1),
}
VARIANTS = ("f32_linear", "f32_input_major", "bf16_linear", "int8_kernel", "int4_kernel")
# As QuantizedLinear runs: the kernel below DENSE_MIN_ROWS rows, its bf16 copy from there on.
SERVED = {"int8": "int8_kernel", "int4": "int4_kernel"}


def weight_bytes(variant: str, n: int, k: int) -> int:
    """Bytes of weight (and scales) one call reads."""
    if variant.startswith("f32"):
        return 4 * n * k
    if variant.startswith("bf16"):
        return 2 * n * k
    if variant == "int8_kernel":
        return n * k + 2 * n  # bf16 scale per row
    return n * k // 2 + 4 * n * (k // GROUP_SIZE)  # bf16 scale and zero per group


def make_call(variant: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """One linear of the variant, as the model holds it, called on f32 activations."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)
    linear.weight.copy_(w)
    if variant == "f32_linear":
        return linear
    if variant == "f32_input_major":
        return InputMajorLinear(linear)  # without oneDNN's packed copy, which serves 2+ rows only
    if variant == "bf16_linear":  # QuantizedLinear's bf16 copy, from DENSE_MIN_ROWS rows
        return lambda x, wb=w.bfloat16(): nn.functional.linear(x.bfloat16(), wb).float()
    return QuantizedLinear(w, None, variant.removesuffix("_kernel"), dense=False)


def copies(variant: str, w: torch.Tensor, count: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    first = make_call(variant, w)
    if isinstance(first, nn.Module):  # built once; the copies hold the same values in their own memory
        return [first] + [copy.deepcopy(first) for _ in range(count - 1)]
    return [first] + [make_call(variant, w) for _ in range(count - 1)]


def best_us(calls: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, reps: int) -> float:
    """Best over `reps` passes of the mean time of one call, each pass calling every copy in turn
    (at least 20 calls a pass)."""
    rounds = max(1, -(-20 // len(calls)))
    for c in calls[:3]:
        c(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for c in calls:
                c(x)
        best = min(best, (time.perf_counter() - t0) / (rounds * len(calls)))
    return best * 1e6


def time_shapes(shapes: dict[str, tuple[int, int, int]], rows: list[int], threads: list[int],
                reps: int) -> list[dict]:
    out = []
    for name, (n, k, per_step) in shapes.items():
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
        for variant in VARIANTS:
            calls = copies(variant, w, 1 if name == "lm_head" else LAYERS)
            for th in threads:
                torch.set_num_threads(th)
                for m in rows:
                    x = torch.randn(m, k)
                    with torch.inference_mode():
                        us = best_us(calls, x, reps)
                    gbps = weight_bytes(variant, n, k) / us / 1e3
                    out.append(dict(shape=name, n=n, k=k, per_step=per_step, variant=variant, threads=th, rows=m,
                                    us=round(us, 2), weight_bytes=weight_bytes(variant, n, k), gb_per_s=round(gbps, 2)))
                    print(f"{name:>12} {n:>5}x{k:<5} {variant:>16} t{th} rows {m:>2}: {us:9.1f} us {gbps:6.1f} GB/s",
                          flush=True)
            del calls
    return out


def served_us(results: list[dict], variant: str, shape: str, threads: int, rows: int) -> tuple[float, int]:
    """(µs, weight bytes) of one call of `shape` as the model runs it: a measured variant, or
    int8 / int4 as QuantizedLinear dispatches (its kernel below DENSE_MIN_ROWS rows, else its bf16 copy)."""
    if variant in SERVED:
        variant = SERVED[variant] if rows < DENSE_MIN_ROWS else "bf16_linear"
    r = next(r for r in results if (r["shape"], r["variant"], r["threads"], r["rows"]) == (shape, variant, threads, rows))
    return r["us"], r["weight_bytes"]


def step_estimate(results: list[dict]) -> dict:
    """Per threads, rows and variant: the sum over one decode step's linears (µs) and the weight
    bytes they read. `auto` is SmolLM2's GGUF as loaded: Q4_1 layers as int4, the Q8_0 head as int8."""
    est: dict = {}
    plans = {v: {} for v in VARIANTS} | {v: {} for v in SERVED} | {"auto": {"lm_head": "int8", "*": "int4"}}
    for th, m in sorted({(r["threads"], r["rows"]) for r in results}):
        cells = est.setdefault(f"threads={th}", {}).setdefault(f"rows={m}", {})
        for name, plan in plans.items():
            us = mb = 0.0
            for shape, (_n, _k, per_step) in SHAPES.items():
                if per_step:
                    variant = plan.get(shape, plan.get("*", name))
                    t, b = served_us(results, variant, shape, th, m)
                    us, mb = us + t * per_step, mb + b * per_step / 1e6
            cells[name] = {"us": round(us, 1), "weight_mb": round(mb, 1)}
    return est


def reference_path(reps: int) -> dict:
    """The kernels with float32 activations and scales (their unvectorized path) against bf16, one
    thread, one row, 1536x576."""
    torch.set_num_threads(1)
    n, k = FFN, HIDDEN
    w = torch.randn(n, k) * 0.05
    x = torch.randn(1, k)
    res = {}
    for mode in ("int8", "int4"):
        quant = QuantizedLinear(w, None, mode, dense=False)
        f32 = copy.deepcopy(quant)
        f32.scales = f32.scales.float()
        if mode == "int4":
            fn = lambda x, m=f32: torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, GROUP_SIZE, m.scales)  # noqa: E731
        else:
            fn = lambda x, m=f32: torch._weight_int8pack_mm(x, m.qweight, m.scales)  # noqa: E731
        with torch.inference_mode():
            res[mode] = {"f32_activations_us": round(best_us([fn], x, reps), 1),
                         "bf16_activations_us": round(best_us([quant], x, reps), 1)}
    with torch.inference_mode():
        res["f32_gemm_us"] = round(best_us([make_call("f32_input_major", w)], x, reps), 1)
    return res


def accuracy() -> dict:
    """Relative RMS error of a quantized linear's output against float64, on Gaussian weights and
    16 Gaussian rows; and GGUF Q8_0 -> per-row int8: the added weight error (relative RMS)."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    gen = torch.Generator().manual_seed(1)
    res: dict = {}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        n, k, _ = SHAPES[name]
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(16, k, generator=gen)
        exact = x.double() @ w.double().t()
        with torch.inference_mode():
            res[name] = {mode: round(float((QuantizedLinear(w, None, mode, dense=False)(x).double() - exact).norm()
                                           / exact.norm()), 5)
                         for mode in ("int8", "int4")}
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).numpy()
    q8 = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).reshape(w.shape)
    row = dequantize_int8(*quantize_int8(torch.from_numpy(q8))).numpy()
    rms = float(np.sqrt((w ** 2).mean()))
    res["q8_0_to_row_int8"] = {
        "q8_0_error_rel_rms": round(float(np.sqrt(((q8 - w) ** 2).mean())) / rms, 5),
        "added_by_requantizing_rel_rms": round(float(np.sqrt(((row - q8) ** 2).mean())) / rms, 5),
        "total_rel_rms": round(float(np.sqrt(((row - w) ** 2).mean())) / rms, 5)}
    try:
        path = known_model_path(known_model("smollm2-135m-instruct"))
    except ModelLoadError:
        return res
    emb = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    q8 = quants.dequantize(emb.data, emb.tensor_type).reshape(VOCAB, HIDDEN)
    row = dequantize_int8(*quantize_int8(torch.from_numpy(q8))).numpy()
    res["smollm2_embedding_q8_0_to_row_int8_added_rel_rms"] = round(
        float(np.sqrt(((row - q8) ** 2).mean()) / np.sqrt((q8 ** 2).mean())), 5)
    return res


def table(est: dict) -> str:
    names = list(next(iter(next(iter(est.values())).values())))
    lines = [f"{'one decode step, linears (us)':>30} " + " ".join(f"{v:>15}" for v in names)]
    for th, per_rows in est.items():
        for rows, cells in per_rows.items():
            lines.append(f"{th + ' ' + rows:>30} " + " ".join(f"{cells[v]['us']:>15.0f}" for v in names))
    for rows, cells in next(iter(est.values())).items():
        lines.append(f"{'weight MB read, ' + rows:>30} " + " ".join(f"{cells[v]['weight_mb']:>15.1f}" for v in names))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="passes per measurement; the best is kept")
    ap.add_argument("--threads", default="1,2", help="PyTorch thread counts (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="rows 1 and 16, one thread, 3 passes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "quant_matmul.json")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    rows, threads, reps = ([1, 16], [1], 3) if a.quick else ([1, 4, 8, 16], threads, a.reps)
    acc = accuracy()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0, load_before = time.time(), os.getloadavg()[0]
        results = time_shapes(SHAPES, rows, threads, reps)
        ref = reference_path(reps)
        seconds, load_after = time.time() - t0, os.getloadavg()[0]
    est = step_estimate(results)
    print(table(est))
    print("float32 activations (reference path) against bf16, 1 thread, 1 row, 1536x576:", json.dumps(ref))
    print("accuracy:", json.dumps(acc))
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "cores": os.cpu_count(),
                    "note": "shared 2-core machine; best-of-N timings under " + LOCK},
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/decode/quant_matmul.py"
                   + (" --quick" if a.quick else f" --reps {reps} --threads {a.threads}"),
        "timed_seconds": round(seconds, 1), "reps": reps,
        "load_average_1min": {"before": load_before, "after": load_after},
        "step_linears": "30 x (qkv_proj, o_proj, gate_up_proj, down_proj) + lm_head, as the fused model runs",
        "step_estimate": est, "float32_activation_path": ref, "accuracy": acc, "shapes": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
