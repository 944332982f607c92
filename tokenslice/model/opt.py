"""OPT family (the FastServe and ALISE evaluation models). Parameter names match HF checkpoints."""
from __future__ import annotations

import torch
from torch import nn

from tokenslice.model.arch import ArchConfig
from tokenslice.model.attention import AttentionMetadata, paged_attention
from tokenslice.model.layers import activation

# OPT's learned position table starts 2 rows in (a fairseq convention kept by the checkpoints).
OPT_POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = a.num_heads, a.head_dim
        width = a.num_heads * a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, width, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, width, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, width, bias=a.qkv_bias)
        self.out_proj = nn.Linear(width, a.hidden_size, bias=a.o_bias)
        self.scale = a.head_dim ** -0.5

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        shape = (t, self.num_heads, self.head_dim)
        o = paged_attention(self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape),
                            kv_layer, meta, self.scale)
        return self.out_proj(o.reshape(t, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.pre_norm = a.do_layer_norm_before
        self.self_attn = OPTAttention(a)
        self.self_attn_layer_norm = nn.LayerNorm(a.hidden_size, elementwise_affine=a.layer_norm_affine)
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.final_layer_norm = nn.LayerNorm(a.hidden_size, elementwise_affine=a.layer_norm_affine)
        self.act = activation(a.hidden_act)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_layer, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        proj = a.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(a.vocab_size, proj)
        self.embed_positions = nn.Embedding(a.max_position_embeddings + OPT_POSITION_OFFSET, a.hidden_size)
        self.project_in = nn.Linear(proj, a.hidden_size, bias=False) if proj != a.hidden_size else None
        self.project_out = nn.Linear(a.hidden_size, proj, bias=False) if proj != a.hidden_size else None
        self.final_layer_norm = (nn.LayerNorm(a.hidden_size, elementwise_affine=a.layer_norm_affine)
                                 if a.final_layer_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(a) for _ in range(a.num_layers))


class OPTModel(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(a)


class OPTForCausalLM(nn.Module):
    def __init__(self, a: ArchConfig) -> None:
        super().__init__()
        self.arch = a
        self.model = OPTModel(a)
        self.lm_head = nn.Linear(a.word_embed_proj_dim, a.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings and self.lm_head is not None and self.model.decoder.embed_tokens is not None:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def keep_stage(self, first: bool, last: bool) -> None:
        """A pipeline stage's model (model/pp.py): embeddings and the input projection only on
        the first, the final norm, output projection and head only on the last."""
        dec = self.model.decoder
        if not first:
            dec.embed_tokens = dec.embed_positions = dec.project_in = None
        if not last:
            dec.final_layer_norm = dec.project_out = None
            self.lm_head = None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward; a later pipeline stage starts from `hidden`."""
        dec = self.model.decoder
        if hidden is None:
            x = dec.embed_tokens(input_ids)
            if dec.project_in is not None:
                x = dec.project_in(x)
            x = x + dec.embed_positions(meta.positions + OPT_POSITION_OFFSET)
        else:
            x = hidden
        for i, layer in enumerate(dec.layers):
            x = layer(x, kv[i], meta)
        if dec.final_layer_norm is not None:
            x = dec.final_layer_norm(x)
        if dec.project_out is not None:
            x = dec.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
