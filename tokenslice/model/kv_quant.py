"""Int8 KV blocks for the host tier (ALISE §3.2, Eq. 8): asymmetric, per channel, per block.

A channel is one (layer, k/v, block, kv_head, head_dim) coordinate; its values are the block's
`block_size` tokens. Each is stored as q = round((x - min) / s) in 0..255 with s = (max - min)
/ 255 (Eq. 8 with a floating zero point). Offloaded KV then crosses the host link in one byte
per value plus per-channel metadata, and is quantized on the device before the device->host
copy and dequantized on the device after the host->device copy.

Metadata (the Eq. 8 scale and zero point), per channel:
* `zero` = the channel minimum, in the KV dtype: it is one of the values, so it is exact and a
  constant channel (max == min) comes back bit-identical.
* `span` = max - min (that is 255 * scale), fp32, rounded toward zero. fp32 rather than fp16:
  a rounded fp16 scale is off by up to 2^-11 relatively, which at q = 255 shifts the top of the
  channel by ~0.12 step, and fp16 under/overflows for ranges below ~6e-5 or above 65504 (bf16
  KV has both); rounding toward zero keeps every value's q <= 255. The span, not the scale:
  a difference of two floats that underflows is exact, a scale 255 times smaller is not.
Cost per channel: block_size bytes + 4 + the KV element size (16 + 6 bytes against 32 for an
fp16 block of 16 tokens; 16 + 8 against 64 for fp32).

Guarantee (tests/test_kv_quant.py checks it): for finite inputs whose channel range fits in
fp32, every value comes back within (max - min) / 255 of the original. Both directions compute
in fp64, so the only rounding that matters is the final one to the KV dtype, which at most
doubles the half-step quantization error. The work goes in chunks of whole blocks (cache-sized
on CPU, where large fresh temporaries cost more in page faults than the arithmetic).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

SPAN_DTYPE = torch.float32
LEVELS = 255  # 8 bits, asymmetric: 0..255
CPU_CHUNK_ELEMS = 1 << 17  # values per chunk on CPU: fp64 temporaries of 1 MiB stay in cache
ACCEL_CHUNK_ELEMS = 1 << 25  # on an accelerator: few launches, fp64 temporaries <= 256 MiB


@dataclass
class QuantizedBlocks:
    """KV blocks [..., n, block_size, kv_heads, head_dim] as 8-bit codes plus per-channel
    metadata [..., n, kv_heads, head_dim] (the block_size axis reduced)."""

    q: torch.Tensor  # uint8 codes
    span: torch.Tensor  # fp32: max - min per channel, rounded toward zero
    zero: torch.Tensor  # KV dtype: min per channel

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.span, self.zero

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
              pin_memory: bool = False) -> QuantizedBlocks:
        """Uninitialized storage for blocks of `shape` (the full-precision shape) in `dtype`."""
        meta = shape[:-3] + shape[-2:]
        return QuantizedBlocks(torch.empty(shape, dtype=torch.uint8, device=device, pin_memory=pin_memory),
                               torch.empty(meta, dtype=SPAN_DTYPE, device=device, pin_memory=pin_memory),
                               torch.empty(meta, dtype=dtype, device=device, pin_memory=pin_memory))


def quantized_block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> int:
    """Bytes of one int8 KV block (all layers, K and V) with its metadata."""
    channels = num_layers * 2 * kv_heads * head_dim
    return channels * (block_size + torch.finfo(SPAN_DTYPE).bits // 8 + torch.finfo(dtype).bits // 8)


def quantize_blocks(x: torch.Tensor, out: QuantizedBlocks | None = None) -> QuantizedBlocks:
    """Quantize blocks x [..., n, block_size, kv_heads, head_dim] (any float dtype, any device;
    views welcome). Writes into `out` (same shape, possibly strided views, e.g. host slices)
    when given."""
    if out is None:
        out = QuantizedBlocks.empty(tuple(x.shape), x.dtype, x.device)
    rows = _as_rows(x, *out.tensors())
    if rows is None:  # leading dims not mergeable into one: one leading index at a time
        for i in range(x.shape[0]):
            quantize_blocks(x[i], QuantizedBlocks(out.q[i], out.span[i], out.zero[i]))
        return out
    x5, q5, span5, zero5 = rows
    scratch = _Scratch(x)
    for idx in _chunks(x5):
        xs = x5[idx]
        lo = xs.amin(-3)  # exact: values of x
        lo64 = lo.double()
        span = _round_toward_zero_f32(xs.amax(-3).double().sub_(lo64))
        # A constant channel has span 0: all its codes are 0 and it decodes to `zero` exactly.
        inv = torch.where(span > 0, LEVELS / span.double(), 0.0)
        t = scratch.like(xs).copy_(xs).sub_(lo64.unsqueeze(-3)).mul_(inv.unsqueeze(-3))
        q5[idx].copy_(t.round_().clamp_(0, LEVELS))
        span5[idx].copy_(span)
        zero5[idx].copy_(lo)
    return out


def dequantize_blocks(qb: QuantizedBlocks, out: torch.Tensor) -> torch.Tensor:
    """Decode into `out` [..., n, block_size, kv_heads, head_dim] (its dtype is the KV dtype;
    a strided view is fine); returns out."""
    rows = _as_rows(out, *qb.tensors())
    if rows is None:
        for i in range(out.shape[0]):
            dequantize_blocks(QuantizedBlocks(qb.q[i], qb.span[i], qb.zero[i]), out[i])
        return out
    out5, q5, span5, zero5 = rows
    scratch = _Scratch(out)
    for idx in _chunks(out5):
        step = span5[idx].double().div_(LEVELS).unsqueeze(-3)
        y = scratch.like(out5[idx]).copy_(q5[idx]).mul_(step).add_(zero5[idx].unsqueeze(-3))
        out5[idx].copy_(y)  # the one rounding to the KV dtype
    return out


class _Scratch:
    """One fp64 buffer reused by every chunk of a call: a fresh temporary per chunk costs more
    in allocation and page faults than the arithmetic on it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.buf: torch.Tensor | None = None
        self.device = x.device

    def like(self, t: torch.Tensor) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < t.numel():
            self.buf = torch.empty(t.numel(), dtype=torch.float64, device=self.device)
        return self.buf[: t.numel()].view(t.shape)


def _round_toward_zero_f32(r: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32 rounding toward zero (r >= 0), so that codes never exceed 255."""
    f = r.to(SPAN_DTYPE)
    return torch.where(f.double() > r, torch.nextafter(f, torch.zeros_like(f)), f)


def _as_rows(x: torch.Tensor, q: torch.Tensor, span: torch.Tensor,
             zero: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Views with the leading dims merged: x and q [rows, n, bs, kvh, hd], span and zero
    [rows, n, kvh, hd]. A (layers, 2, n-block slice) of the KV layout merges; None if some
    tensor's leading dims do not (views never copy, so writes land in the caller's memory)."""
    if x.dim() < 4:
        raise ValueError(f"expected [..., n, block_size, kv_heads, head_dim], got shape {tuple(x.shape)}")
    try:
        return (x.view(-1, *x.shape[-4:]), q.view(-1, *q.shape[-4:]), span.view(-1, *span.shape[-3:]),
                zero.view(-1, *zero.shape[-3:]))
    except RuntimeError:
        return None


def _chunks(x: torch.Tensor) -> Iterator[tuple[int | slice, ...]]:
    """Index tuples covering x [rows, n, bs, kvh, hd] in pieces of whole blocks: cache-sized on
    CPU, large on an accelerator (few launches, bounded fp64 temporaries)."""
    limit = CPU_CHUNK_ELEMS if x.device.type == "cpu" else ACCEL_CHUNK_ELEMS
    rows, n = x.shape[0], x.shape[1]
    per_block = max(1, x.shape[2] * x.shape[3] * x.shape[4])
    per_chunk = max(1, limit // per_block)  # blocks
    if n <= per_chunk:  # several whole rows per chunk
        step = per_chunk // n
        for r in range(0, rows, step):
            yield (slice(r, r + step),)
        return
    for r in range(rows):
        for start in range(0, n, per_chunk):
            yield (r, slice(start, start + per_chunk))
