"""Sections env (machine, versions, memory bandwidths) and triton-kernels (the paged attention
kernels of tokenslice/model/triton_attention.py against an fp32 SDPA reference, and their time
against the SDPA gather path)."""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import Any

from check_common import Recorder, best_seconds, copy_gbps, pinned_gbps

CARRIED = ("fastapi", "starlette", "pydantic", "pydantic-core", "typing-extensions", "opentelemetry-api", "uvicorn",
           "msgspec", "pyzmq", "gguf")
# What `tokenslice serve` and the GGUF loader import, carried wheels included.
SERVE_IMPORTS = ("fastapi", "uvicorn", "zmq", "msgspec", "gguf", "tokenslice.server.app", "tokenslice.engine.core")
# Max abs error allowed against the fp32 reference (tests/test_triton_attention.py's tolerances).
TOLERANCE = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def env(rec: Recorder) -> None:
    import torch
    p = rec.profile
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "numpy", "safetensors", "tokenizers", *CARRIED):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    rec.state["data"]["versions"] = versions
    missing = [n for n in CARRIED if versions[n] is None]
    rec.row("versions", ", ".join(f"{k} {v}" for k, v in versions.items()),
            verdict="fail" if missing else "pass")
    failed = {}
    for module in SERVE_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as e:  # an import error of any kind is the finding
            failed[module] = f"{type(e).__name__}: {e}"[:200]
    rec.row("serving stack imports", "; ".join(f"{m}: {e}" for m, e in failed.items()) or ", ".join(SERVE_IMPORTS),
            verdict="fail" if failed else "pass")
    if p.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        rec.row("gpu", props.name, {"memory_GiB": round(props.total_memory / 2**30, 1), "SMs": props.multi_processor_count,
                                     "cuda": torch.version.cuda})
    else:
        rec.row("gpu", "none: CPU dry run", {"cpus": torch.get_num_threads(), "machine": platform.machine()})
    with rec.case("device copy bandwidth"):
        gbps = copy_gbps(p.device, p.copy_bytes)
        rec.row("device copy bandwidth", f"{p.copy_bytes >> 20} MiB copied, read + write counted",
                {"GBps": round(gbps, 1)})
    with rec.case("pinned host<->device bandwidth"):
        if p.device != "cuda":
            rec.row("pinned host<->device bandwidth", "skipped: pinned memory needs CUDA", verdict="skipped")
        else:
            bw = pinned_gbps(p.pinned_bytes)
            rec.row("pinned host<->device bandwidth", f"{p.pinned_bytes >> 20} MiB each way",
                    {k: round(v, 1) for k, v in bw.items()})


def _case(dtype: Any, heads: int, kv_heads: int, hd: int, block_size: int, lens: list[int], device: str,
          seed: int) -> tuple[Any, Any, Any]:
    """A KV pool with shuffled blocks and each sequence's block table."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    k = torch.randn(num_blocks, block_size, kv_heads, hd, generator=gen).to(device, dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, hd, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[:len(lens) * width].view(len(lens), width).to(device=device, dtype=torch.int32)
    return k, v, tables


def _reference(q: Any, k: Any, v: Any, table: Any, ctx: int, scale: float) -> Any:
    """fp32 SDPA for one sequence: its last len(q) positions attend causally to its ctx keys."""
    import torch
    import torch.nn.functional as F
    bs = k.shape[1]
    pos = torch.arange(ctx, device=k.device)
    blocks = table.long()[pos // bs]
    kk, vv = (c[blocks, pos % bs].float().transpose(0, 1) for c in (k, v))  # [KVH, ctx, hd]
    mask = pos[None, :] <= (ctx - q.shape[0] + torch.arange(q.shape[0], device=k.device))[:, None]
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), kk, vv, attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def _errors(ta: Any, dtype: str, shape: tuple[int, int, int], block_size: int, rec: Recorder) -> dict[str, float]:
    import torch
    p, dt = rec.profile, getattr(torch, dtype)
    heads, kv_heads, hd = shape
    scale = hd ** -0.5
    lens = list(p.decode_lens)
    k, v, tables = _case(dt, heads, kv_heads, hd, block_size, lens, p.device, seed=block_size + hd)
    q = torch.randn(len(lens), heads, hd).to(p.device, dt)
    ctx = torch.tensor(lens, dtype=torch.int32, device=p.device)
    out = ta.paged_decode_attention(q, k, v, tables, ctx, scale)
    dec = max(float((out[i:i + 1].float() - _reference(q[i:i + 1], k, v, tables[i], n, scale)).abs().max())
              for i, n in enumerate(lens))
    qlens, klens = [c[0] for c in p.prefill_cases], [c[1] for c in p.prefill_cases]
    k, v, tables = _case(dt, heads, kv_heads, hd, block_size, klens, p.device, seed=7 * block_size + hd)
    q = torch.randn(sum(qlens), heads, hd).to(p.device, dt)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=p.device)
    out = ta.paged_prefill_attention(q, k, v, tables, qsl, torch.tensor(klens, dtype=torch.int32, device=p.device),
                                     scale)
    pre = max(float((out[a:b].float() - _reference(q[a:b], k, v, tables[i], klens[i], scale)).abs().max())
              for i, (a, b) in enumerate(zip(starts, starts[1:])))
    return {"decode_err": dec, "prefill_err": pre}


def _gather_path(q: Any, k: Any, v: Any, tables: Any, lens: list[int], scale: float) -> Any:
    """Inputs of the engine's SDPA decode path (context gathered through slot indices), as a call."""
    import torch
    from tokenslice.model import attention
    d, bs = len(lens), k.shape[1]
    lmax = max(lens)
    kpos = torch.arange(lmax, device=k.device)
    slots = (tables.long()[:, kpos // bs] * bs + kpos % bs).reshape(-1)
    mask = (kpos[None, :] < torch.tensor(lens, device=k.device)[:, None]).view(d, 1, 1, lmax)
    kf, vf = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
    return lambda: attention._decode_attention(q, kf, vf, slots, mask, scale)


def triton_kernels(rec: Recorder) -> None:
    p = rec.profile
    try:
        ta = importlib.import_module("tokenslice.model.triton_attention")
    except ImportError as e:
        rec.row("kernels module", f"missing: tokenslice.model.triton_attention does not import ({e})", verdict="fail")
        return
    rec.row("triton_available()", str(ta.triton_available()), {"interpreter": p.dry_run},
            verdict="pass" if ta.triton_available() else "fail")
    with rec.case("decode time"):  # first: the accuracy cases after it may use up the budget compiling
        rec.need(5, "decode time")
        _decode_time(rec, ta)
    for dtype in p.kernel_dtypes:
        for shape in p.kernel_shapes:
            for bs in p.kernel_block_sizes:
                check = f"{dtype} {shape[0]}q/{shape[1]}kv hd{shape[2]} block {bs}"
                with rec.case(check):
                    rec.need(3, check)
                    err = _errors(ta, dtype, shape, bs, rec)
                    ok = max(err.values()) <= TOLERANCE[dtype]
                    rec.row(check, f"max abs error vs fp32 SDPA (tolerance {TOLERANCE[dtype]:g})",
                            {k: float(f"{v:.3g}") for k, v in err.items()}, "pass" if ok else "fail")


def _decode_time(rec: Recorder, ta: Any) -> None:
    """The decode kernel against the engine's SDPA gather path, 32q/8kv hd128 bf16, block 16."""
    import torch
    p = rec.profile
    rows, ctx, reps = p.kernel_bench
    dt = torch.bfloat16
    lens = [ctx] * rows
    k, v, tables = _case(dt, 32, 8, 128, 16, lens, p.device, seed=1)
    q = torch.randn(rows, 32, 128).to(p.device, dt)
    ctx_t = torch.tensor(lens, dtype=torch.int32, device=p.device)
    out = torch.empty_like(q)
    kernel, _ = best_seconds(lambda: ta.paged_decode_attention(q, k, v, tables, ctx_t, 128 ** -0.5, out),
                             p.device, reps=3, inner=reps)
    gather, _ = best_seconds(_gather_path(q, k, v, tables, lens, 128 ** -0.5), p.device, reps=3, inner=reps)
    kv_bytes = 2 * rows * ctx * 8 * 128 * 2
    rec.row(f"decode time, {rows} rows x {ctx} keys, 32q/8kv hd128 bf16",
            f"triton kernel vs the SDPA gather path (best of 3 x {reps} calls)",
            {"triton_us": round(kernel * 1e6, 1), "sdpa_gather_us": round(gather * 1e6, 1),
             "speedup": round(gather / kernel, 2), "triton_kv_GBps": round(kv_bytes / kernel / 1e9, 1)},
            "info" if p.dry_run else ("pass" if kernel < gather else "fail"))
