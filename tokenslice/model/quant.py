"""Weight-only quantized linears for CPU decode, which is weight-bandwidth bound: a step reads every
weight once (SmolLM2-135M as its GGUF loads, int4 layers and an int8 head: 95 MB against 538 MB in
f32; one thread, one row, its linears took 23 ms against 45 ms, benchmarks/decode/quant_matmul.py).

Formats (w is the weight the layer multiplies by, [out N, in K]):
- int4: group-wise asymmetric, groups of GROUP_SIZE inputs; w = (q - 8) * scale + zero, q in 0..15,
  run by torch.ops.aten._weight_int4pack_mm_for_cpu (scales and zeros [K/32, N, 2]). A GGUF Q4_1
  block (w = q·d + m) is the case scale = d, zero = m + 8d; quantizing from a float weight takes the
  group's min and max, so a dequantized Q4_1 block (its min and max are on its grid) gives back
  the same q, d and m, and in float32 the kernel's weights match GGUF's dequantization bit for bit.
- int8: symmetric per output row, w = q * scale, q in -127..127, run by torch._weight_int8pack_mm.
  A GGUF Q8_0 weight (a scale per block of 32) is requantized to one scale per row, which adds a
  relative RMS error of 1.2% on SmolLM2's embedding (0.7% on Gaussian weights).

Both kernels run with bfloat16 activations, scales and outputs, converted from and to the model's
dtype around the call: with float32 ones they take an unvectorized path, slower than the f32 GEMM
(AVX-512 CPU, one thread, 1 row, 1536x576: int4 3036 us, int8 1188 us, f32 GEMM 211 us; with bf16:
int4 106 us, int8 88 us). The bf16 roundings of the input, the scales and the output add a
relative error of ~2^-8 on top of the quantization's.

The kernels' time grows with every row (3072x576, 1 -> 16 rows: int4 246 -> 1180 us), a GEMM's
barely (bf16: 640 -> 675 us): from DENSE_MIN_ROWS rows on (prefill, batched decode) a layer
multiplies by a bfloat16 copy of its quantized weight instead, 2 more bytes per weight
(SmolLM2-135M: 95 MB quantized + 269 MB bf16, against 538 MB in f32); `dense=False` keeps none.
Compiled code (decode) always runs the kernel.

Call quantize_linears once the weights are final: after loading, the dtype cast and fuse(), before
or after layers.use_input_major_linears (it takes either kind of linear).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenslice.model.layers import InputMajorLinear

log = logging.getLogger(__name__)

MODES = ("int8", "int4")
GROUP_SIZE = 32  # GGUF's Q4_1 / Q8_0 block
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
# _weight_int8pack_mm (bf16, AVX-512) gives wrong sums, or crashes, for 2+ rows when K % 16 != 0.
INT8_K_MULTIPLE = 16
COMPUTE_DTYPE = torch.bfloat16  # see the module docstring for why not float32
# SmolLM2's step linears, one thread: at 8 rows the bf16 copy 49 ms, int4 60; at 4 rows 54 and 31.
DENSE_MIN_ROWS = 8
# Linears that fuse() builds from checkpoint ones (llama.py), for a plan keyed by checkpoint names.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PRECISION = {"int4": 0, "int8": 1, None: 2}  # lowest first

Plan = dict[str, str | None] | str


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min/max int4 of a [N, K] weight: q int32 [N, K] in 0..15 and float32 scales and
    zeros [K/group, N, 2], with w ≈ (q - 8) * scale + zero and |error| ≤ scale / 2."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    # A constant group has scale 0: every q is 0 and the zero alone gives its value back.
    q = torch.where(scale > 0, (g - lo) / scale, 0).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return q, torch.stack([scale, zero], -1).reshape(n, k // group_size, 2).transpose(0, 1).contiguous()


def dequantize_int4(q: torch.Tensor, scales_zeros: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The weight [N, K] the kernel multiplies by: one fused multiply-add per value, as it does."""
    scale, zero = (t.t().repeat_interleave(group_size, 1) for t in scales_zeros.float().unbind(-1))
    return torch.addcmul(zero, (q - 8).float(), scale)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a [N, K] weight: q int8 [N, K] and float32 scales [N], with
    w ≈ q * scale and |error| ≤ scale / 2."""
    w = w.detach().float().contiguous()  # the kernel reads q row-major
    scale = w.abs().amax(1) / 127
    q = torch.where(scale[:, None] > 0, w / scale[:, None], 0).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def kernel_fits(mode: str, out_features: int, in_features: int) -> bool:
    """Whether the mode's CPU kernel takes a weight of this shape."""
    if mode == "int4":
        return in_features % GROUP_SIZE == 0 and out_features % INT4_N_MULTIPLE == 0
    return in_features % INT8_K_MULTIPLE == 0


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b with W held as int8 or int4, and as a bf16 copy for many rows unless `dense` is
    False (module docstring); the bias stays in float."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dense: bool = True) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"quantization mode must be one of {', '.join(MODES)}, got {mode!r}")
        if weight.device.type != "cpu":
            raise ValueError(f"quantized linears run on CPU only; this weight is on {weight.device}")
        self.out_features, self.in_features = weight.shape
        if not kernel_fits(mode, self.out_features, self.in_features):
            raise ValueError(f"{mode} kernel does not take a [{self.out_features}, {self.in_features}] weight")
        self.mode = mode
        if mode == "int4":
            q, scales = quantize_int4(weight)
            # innerKTiles is ignored on CPU; the packed weight is [N, K/2] uint8.
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            w_hat = dequantize_int4(q, scales) if dense else None
        else:
            packed, scales = quantize_int8(weight)
            w_hat = dequantize_int8(packed, scales) if dense else None
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE))
        # The quantized weights, not the float ones: a row's result must not depend on its batch.
        self.register_buffer("dense", None if w_hat is None else w_hat.to(COMPUTE_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        # Traced code (compiled decode) sees only the kernel: no guard on the row count.
        if self.dense is not None and x2.shape[0] >= DENSE_MIN_ROWS and not torch.compiler.is_compiling():
            y = nn.functional.linear(x2, self.dense)
        elif self.mode == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, GROUP_SIZE, self.scales)
        else:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, mode={self.mode}, bias={self.bias is not None}, "
                f"dense={self.dense is not None}")


def quantize_linears(model: nn.Module, plan: Plan, dense: bool = True) -> int:
    """Replace, in their parents, the linears (nn.Linear or InputMajorLinear) that `plan` quantizes;
    returns how many were replaced.

    `plan` is one mode for every linear, or maps weight names as in
    `model.named_parameters(remove_duplicate=False)` ("lm_head.weight", ...) to "int8", "int4" or
    None (float). A linear fuse() built (qkv_proj, gate_up_proj) is looked up by its own name, else
    takes the lowest precision its listed parts (q/k/v_proj, gate/up_proj) ask for, so a plan keyed
    by checkpoint tensors works on a fused model. A head tied to the embedding gets its own
    quantized copy; the embedding keeps its float table for the lookup. A weight whose shape the
    kernel does not take stays float (logged). `dense`: keep bf16 copies for many rows (QuantizedLinear)."""
    if isinstance(plan, str) and plan not in MODES:
        raise ValueError(f"quantization mode must be one of {', '.join(MODES)}, got {plan!r}")
    if isinstance(plan, dict):
        bad = {k: v for k, v in plan.items() if v is not None and v not in MODES}
        if bad:
            raise ValueError(f"quantization plan: unknown modes {bad}; use {', '.join(MODES)} or None")
    used: set[str] = set()
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            path = f"{name}.{child_name}" if name else child_name
            weight = _float_weight(child)
            if weight is None:
                continue
            mode = plan if isinstance(plan, str) else _planned_mode(plan, path, used)
            if mode is None:
                continue
            if not kernel_fits(mode, *weight.shape):
                log.info("%s: %s kernel does not take a %s weight; it stays %s", path, mode,
                         list(weight.shape), weight.dtype)
                continue
            setattr(module, child_name, QuantizedLinear(weight, child.bias, mode, dense))
            replaced += 1
    if isinstance(plan, dict) and set(plan) - used:
        log.warning("quantization plan names weights no linear has: %s", ", ".join(sorted(set(plan) - used)))
    return replaced


def _float_weight(module: nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of a non-empty float linear (fuse() leaves its parts empty), else None."""
    if isinstance(module, nn.Linear):
        weight = module.weight
    elif isinstance(module, InputMajorLinear):
        weight = module.weight_t.t()
    else:
        return None
    return weight if weight.numel() and weight.is_floating_point() else None


def _planned_mode(plan: dict[str, str | None], path: str, used: set[str]) -> str | None:
    key = f"{path}.weight"
    if key in plan:
        used.add(key)
        return plan[key]
    parent, _, leaf = path.rpartition(".")
    parts = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in FUSED_PARTS.get(leaf, ())]
    listed = [p for p in parts if p in plan]
    used.update(listed)
    return min((plan[p] for p in listed), key=_PRECISION.__getitem__, default=None)
