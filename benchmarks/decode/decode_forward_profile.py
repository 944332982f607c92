"""Where the decode forward's time goes on the 24M Llama (benchmarks/common/llama24m.py), fp32, CPU,
one torch thread (as the engine core runs): torch.profiler per op class, against the floor of
reading every weight once per step, plus the eager step time (forward + head + greedy argmax)
with the linears on MKL alone and with oneDNN's packed weights for multi-row steps (as loaded),
alternating round by round so that machine drift hits both alike, and the same step compiled
(model/compiled_decode.py, as `serve` runs it by default; its own call adds the step's metadata). Step times are this thread's
CPU time (one torch thread does all the work), which a loaded machine disturbs far less than wall
time; the profiler's self times carry its own overhead.

Decode rows sit at position `--ctx` (64-token prompts, mid-way through 128 new tokens), each in
its own blocks of the KV pool; the step is the model's own forward on real metadata
(attention.step_metadata), so prepare and scheduling are left out (step_breakdown.py has them).

    .venv/bin/python benchmarks/decode/decode_forward_profile.py [--batches 1,16] [--ctx 128] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch


from tokenslice.config import ModelConfig  # noqa: E402
from tokenslice.model.attention import step_metadata  # noqa: E402
from tokenslice.model.compiled_decode import CompiledDecode  # noqa: E402
from tokenslice.model.input_batch import DecodeInputs  # noqa: E402
from tokenslice.model.layers import InputMajorLinear  # noqa: E402
from tokenslice.model.loader import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama24m import build_llama24m  # noqa: E402

BLOCK = 16
# Op name fragments -> class, first match wins (aten names as the profiler records them).
CLASSES = (
    ("linear / matmul", ("addmm", "aten::mm", "matmul", "linear", "aten::bmm")),
    ("attention: sdpa", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("attention: KV gather", ("index_select",)),
    ("KV cache write", ("index_copy", "index_put")),
    ("rotary", ("aten::cat", "aten::neg", "aten::index")),
    ("norms", ("rsqrt", "aten::pow", "aten::mean")),
    ("activation", ("silu",)),
    ("embedding", ("embedding",)),
    ("sampling", ("argmax",)),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub")),
    ("copies / views", ("copy_", "contiguous", "clone", "aten::to", "_to_copy", "reshape", "view",
                        "transpose", "split", "chunk", "unsqueeze", "squeeze", "slice", "select",
                        "expand", "empty", "as_strided", "t", "unbind", "narrow", "alias", "detach")),
)


def classify(name: str) -> str:
    for cls, parts in CLASSES:
        if any(p in name for p in parts):
            return cls
    return "other"


def decode_rows(batch: int, ctx: int) -> DecodeInputs:
    width = ctx // BLOCK + 1
    tables = np.arange(batch * width, dtype=np.int64).reshape(batch, width)
    return DecodeInputs(token_ids=np.arange(3, 3 + batch, dtype=np.int64),
                        positions=np.full(batch, ctx, dtype=np.int64), tables=tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", action="store_true", help="also print the 25 costliest ops by shape")
    ap.add_argument("--model", default="", help="a checkpoint directory (default: build the 24M Llama)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = a.model or str(Path(d) / "llama24m")
        if not a.model:
            build_llama24m(Path(path))
        loaded = load_model(ModelConfig(model=path, dtype="float32", device="cpu"), with_tokenizer=False)
    model, arch = loaded.model, loaded.arch
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, InputMajorLinear)]
    packed = [getattr(m, "packed", None) for m in linears]  # absent before oneDNN packing

    def use_packed(on: bool) -> None:
        for m, p in zip(linears, packed, strict=True):
            m.packed = p if on else None

    for batch in (int(b) for b in a.batches.split(",")):
        dec = decode_rows(batch, a.ctx)
        kv = torch.randn(arch.num_layers, 2, batch * (a.ctx // BLOCK + 1), BLOCK, arch.num_kv_heads,
                         arch.head_dim)
        ids = torch.from_numpy(dec.token_ids)

        def step() -> torch.Tensor:
            meta = step_metadata(dec, [], BLOCK, torch.device("cpu"))
            return model.compute_logits(model(ids, meta, kv)).argmax(-1)

        with torch.inference_mode():
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(10):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    use_packed(on)
                    for _ in range(5):
                        step()
                    for _ in range(a.steps // 10):
                        t0 = time.thread_time()
                        step()
                        times[on].append(time.thread_time() - t0)
            use_packed(any(p is not None for p in packed))
            compiled = CompiledDecode(model, kv, BLOCK, torch.device("cpu"), batch, a.ctx + 1)
            compiled_times = []  # stays empty where the step runs eager (multi-row, packed linears)
            if compiled.logits(dec) is not None:
                for _ in range(5):
                    compiled.logits(dec)
                for _ in range(a.steps):
                    t0 = time.thread_time()
                    compiled.logits(dec).argmax(-1)
                    compiled_times.append(time.thread_time() - t0)
            n_prof = 50
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        record_shapes=True) as prof:
                for _ in range(n_prof):
                    step()
        per_class: dict[str, float] = defaultdict(float)
        for ev in prof.key_averages():
            per_class[classify(ev.key)] += ev.self_cpu_time_total / 1e3 / n_prof  # ms per step
        total = sum(per_class.values())
        mkl_ms, step_ms = (1e3 * statistics.median(times[on]) for on in (False, True))
        floor_ms = 1e3 * weight_bytes / 20e9  # one core's ~20 GB/s streaming read
        compiled_ms = f"{1e3 * statistics.median(compiled_times):.2f} ms" if compiled_times else "runs eager"
        print(f"\nbatch {batch}: step {step_ms:.2f} CPU ms median ({batch / step_ms * 1e3:.0f} tok/s; "
              f"MKL alone {mkl_ms:.2f} ms; compiled decode {compiled_ms}), "
              f"profiled self time {total:.2f} ms/step (profiler overhead "
              f"included); weights {weight_bytes / 1e6:.0f} MB "
              f"(floor ~{floor_ms:.1f} ms at 20 GB/s), {2 * weight_bytes / 4 * batch / 1e6:.0f} MFLOP")
        print(f"{'op class':24s} {'ms/step':>8s} {'share':>6s}")
        for cls, ms in sorted(per_class.items(), key=lambda kv_: -kv_[1]):
            print(f"{cls:24s} {ms:8.3f} {ms / total:6.1%}")
        if a.top:
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
