"""Llama family: Llama 2/3, Qwen2 (qkv bias), Mistral. Parameter names match HF checkpoints."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenslice.model.arch import ArchConfig
from tokenslice.model.attention import AttentionMetadata, paged_attention
from tokenslice.model.layers import RMSNorm, RotaryEmbedding, activation, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.scale = a.head_dim ** -0.5
        self.qkv_proj: nn.Linear | None = None  # built by fuse() after loading

    def fuse(self) -> None:
        """One matmul for q, k and v: fewer, larger GEMMs run faster, most of all on CPU."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            # q and k sit side by side in the fused output: one rotary pass over both heads' sets.
            qk, v = self.qkv_proj(x).split([(h + kvh) * hd, kvh * hd], dim=-1)
            q, k = apply_rotary(qk.view(t, h + kvh, hd), cos, sin).split([h, kvh], dim=1)
        else:
            q = apply_rotary(self.q_proj(x).reshape(t, h, hd), cos, sin)
            k = apply_rotary(self.k_proj(x).reshape(t, kvh, hd), cos, sin)
            v = self.v_proj(x)
        v = v.reshape(t, kvh, hd)
        o = paged_attention(q, k, v, kv_layer, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.act = activation(a.hidden_act)
        self.gate_up_proj: nn.Linear | None = None  # built by fuse() after loading

    def fuse(self) -> None:
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """A Linear whose output is the parts' outputs side by side; the parts keep their
    (checkpoint-named) parameters, which the fused copy no longer reads."""
    w = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    fused.requires_grad_(False)
    return fused


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_eps)
        self.self_attn = LlamaAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_eps)
        self.mlp = LlamaMLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.norm_eps)


@dataclass
class HiddenCapture:
    """Rows of the residual stream after decoder layer `layer`, copied out during a forward pass
    that runs anyway: the model's own features for output-length prediction (TRAIL, arXiv
    2410.01035; predict/self_head.py)."""

    layer: int
    rows: torch.Tensor  # indices into the step's tokens
    out: torch.Tensor | None = None  # [len(rows), hidden], filled by the forward pass


class LlamaForCausalLM(nn.Module):
    supports_hidden_capture = True  # forward takes `capture` (the runner checks before asking)

    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.arch = a
        self.model = LlamaModel(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def keep_stage(self, first: bool, last: bool) -> None:
        """A pipeline stage's model (model/pp.py): the embedding only on the first, the final
        norm and the head only on the last."""
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
            self.lm_head = None

    def fuse(self) -> None:
        """Fuse projections for speed once weights are final; also frees the unfused copies."""
        for layer in self.model.layers:
            for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
                mod.fuse()
                for n in names:  # keep shapes for split sizes, drop the storage
                    getattr(mod, n).weight = nn.Parameter(torch.empty(0), requires_grad=False)
                    getattr(mod, n).bias = None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor,
                hidden: torch.Tensor | None = None, capture: HiddenCapture | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the batch's new tokens; kv is the whole block pool (of
        this stage's layers). A later pipeline stage starts from the previous stage's `hidden`.
        `capture` (whole models only): some rows after one layer are copied into capture.out."""
        x = self.model.embed_tokens(input_ids) if hidden is None else hidden
        cos, sin = self.rotary(meta.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv[i], meta)
            if capture is not None and i == capture.layer:
                capture.out = x.index_select(0, capture.rows)
        return self.model.norm(x) if self.model.norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
