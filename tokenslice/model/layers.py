"""Building blocks shared by the model families: norms, rotary embeddings, activations."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenslice.model.arch import ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference does, so bf16 models match it.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def activation(name: str) -> nn.Module:
    acts = {"silu": nn.SiLU(), "relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_new": nn.GELU(approximate="tanh"),
            "gelu_pytorch_tanh": nn.GELU(approximate="tanh")}
    if name not in acts:
        raise ModelLoadError(f"config.json: unsupported activation {name!r}; supported: {', '.join(acts)}")
    return acts[name]


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths slow down, short ones stay.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled), 1.0
    raise ModelLoadError(f"config.json: unsupported rope scaling {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv, attn_scale = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; the rotate-half convention of Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def onednn_packs_linears(dtype: torch.dtype) -> bool:
    """Whether this CPU build can hold fp32 linear weights in oneDNN's blocked layout."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


PACK_MIN_WEIGHTS = 1 << 16  # a 256 x 256 weight; the 24M model's smallest is 512 x 256
PACKED_LINEARS_MAX_BYTES = 1 << 30  # the packed copies double the linears' memory: small models only


class InputMajorLinear(nn.Module):
    """A Linear whose weight is stored transposed, [in, out] contiguous. On CPU, MKL's GEMM reads
    that layout much faster when few rows multiply it (decode): measured here on a model-sized set
    of weights, 37% faster at 1 row and 17% at 16; equal at 64.

    With `packed`, a second copy of the weight in oneDNN's blocked layout serves every multi-row
    call: on an AVX-512 CPU, one thread, 1.75x MKL at 16 rows, 2x at 4 and 1.3x at 64, but 10%
    slower at 1 row, where MKL's [in, out] copy stays (docs/benchmarks/decode-speed-and-llamacpp.md, "Decode forward on the 24M model").
    Twice the weights' memory, for the CPU's small models."""

    def __init__(self, linear: nn.Linear, packed: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        # Packed for 16 rows: as fast as a per-size packing from 2 rows to 64 (measured). Tiny
        # weights stay on MKL: the gain was measured on 512-wide linears, where GEMM time dominates.
        packed = packed and linear.weight.numel() >= PACK_MIN_WEIGHTS
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16) if packed else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced code (compiled decode) sees only the plain GEMM.
        if self.packed is not None and x.numel() > self.in_features and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight_t).view(*x.shape[:-1], -1)


def use_input_major_linears(model: nn.Module, keep: set[int], packed: bool = False) -> None:
    """Swap every non-empty nn.Linear for an InputMajorLinear (`packed`: with oneDNN's copy too,
    where all linears together take at most PACKED_LINEARS_MAX_BYTES), except those whose weight
    is in `keep` (ids of shared parameters, such as a head tied to the embedding)."""
    linear_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear))
    packed = packed and linear_bytes <= PACKED_LINEARS_MAX_BYTES
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.numel() and id(child.weight) not in keep:
                setattr(parent, name, InputMajorLinear(child, packed))
