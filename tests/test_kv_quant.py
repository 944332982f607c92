"""Int8 KV blocks for the host tier (model/kv_quant.py, ALISE §3.2): the per-channel error bound."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import tokenslice.model.kv_quant as kvq
from tokenslice.model.kv_quant import QuantizedBlocks, dequantize_blocks, quantize_blocks, quantized_block_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check_bound(x: torch.Tensor) -> QuantizedBlocks:
    """Round trip x [..., n, bs, kvh, hd]; every value within (max - min) / 255 of its channel."""
    qb = quantize_blocks(x)
    y = dequantize_blocks(qb, torch.empty_like(x))
    x64 = x.double()
    bound = ((x64.amax(-3) - x64.amin(-3)) / 255).unsqueeze(-3)
    err = (y.double() - x64).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} values over the bound; worst err/bound "
                           f"{float((err / bound.clamp_min(1e-300)).max())}")
    return qb


@st.composite
def kv_blocks(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 8)),
             draw(st.integers(1, 2)), draw(st.integers(1, 3)))  # [layers*2, n, bs, kvh, hd]
    numel = 1
    for d in shape:
        numel *= d
    mode = draw(st.sampled_from(["wide", "narrow", "pool"]))
    if mode == "wide":  # any magnitudes, including channels spanning many binades
        vals = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=numel, max_size=numel))
    elif mode == "narrow":  # channels a few ulps wide: rounding in the arithmetic would show
        base = draw(st.floats(-1e4, 1e4, width=32))
        ulps = draw(st.lists(st.integers(0, 300), min_size=numel, max_size=numel))
        step = abs(base) * 2.0 ** -23 if base else 1e-30
        vals = [base + k * step for k in ulps]
    else:  # few distinct values: constant channels are common
        pool = draw(st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=3))
        vals = draw(st.lists(st.sampled_from(pool), min_size=numel, max_size=numel))
    return torch.tensor(vals, dtype=torch.float64).view(shape).to(dtype)


@settings(max_examples=400, deadline=None)
@given(kv_blocks())
def test_reconstruction_error_is_within_one_step_per_channel(x: torch.Tensor) -> None:
    _check_bound(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_channels_come_back_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 3, 16, 2, 4, generator=g).to(dtype)
    x[0, 1, 2, :, 1, 3] = -0.7  # one constant channel among varying ones
    x[1] = 3.25  # whole layer constant
    qb = _check_bound(x)
    y = dequantize_blocks(qb, torch.empty_like(x))
    assert torch.equal(y[0, 1, 2, :, 1, 3], x[0, 1, 2, :, 1, 3])
    assert torch.equal(y[1], x[1])
    assert (qb.span[1] == 0).all() and (qb.q[1] == 0).all()
    assert qb.q.dtype == torch.uint8 and qb.span.dtype == torch.float32 and qb.zero.dtype == dtype


def test_chunked_path_matches_one_shot_and_writes_strided_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path works in cache-sized chunks and may write straight into host-tier slices."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 2, 10, 4, 2, 8, generator=g)
    one = quantize_blocks(kv[:, :, 2:7])
    monkeypatch.setattr(kvq, "CPU_CHUNK_ELEMS", 100)  # a couple of blocks per chunk
    host = QuantizedBlocks.empty((3, 2, 12, 4, 2, 8), torch.float32)
    view = QuantizedBlocks(*(t[:, :, 5:10] for t in host.tensors()))
    quantize_blocks(kv[:, :, 2:7], view)
    for a, b in zip(one.tensors(), view.tensors(), strict=True):
        assert torch.equal(a, b)
    out = torch.zeros(3, 2, 10, 4, 2, 8)
    dequantize_blocks(view, out[:, :, 1:6])
    monkeypatch.setattr(kvq, "CPU_CHUNK_ELEMS", 1 << 17)
    assert torch.equal(out[:, :, 1:6], dequantize_blocks(one, torch.empty(3, 2, 5, 4, 2, 8)))
    assert (out[:, :, 0] == 0).all() and (out[:, :, 6:] == 0).all()
    # Leading dims that do not merge into one (every other layer): one layer at a time.
    odd = quantize_blocks(kv[::2, :, 2:7])
    for a, b in zip(odd.tensors(), quantize_blocks(kv[::2, :, 2:7].contiguous()).tensors(), strict=True):
        assert torch.equal(a, b)


def test_block_bytes() -> None:
    # 2 layers x K,V x 4 heads x 8 dims = 128 channels; 16 code bytes + fp32 span + fp16 zero each.
    assert quantized_block_bytes(2, 16, 4, 8, torch.float16) == 128 * (16 + 4 + 2)
    assert quantized_block_bytes(2, 16, 4, 8, torch.float32) == 128 * (16 + 4 + 4)
