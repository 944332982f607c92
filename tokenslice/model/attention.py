"""Paged attention over block tables, for decode (one new token) and prefill (many).

KV layout, one tensor for the whole pool: [num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]. Each layer's K (and V) is contiguous, so token slots are rows of a flat
[num_blocks * block_size, kv_heads * head_dim] view and a context gather is one
index_select (per-token advanced indexing on a block-major layout was half the step time).
A run of adjacent blocks is still one strided copy across all layers when it moves tiers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenslice.plan import SeqSlice


@dataclass
class AttentionMetadata:
    """Index tensors for one step, shared by all layers. Decode tokens come first in the batch."""

    positions: torch.Tensor  # [T] position of every new token
    slots: torch.Tensor  # [T] cache row (block * block_size + offset) receiving each new K/V
    num_decode: int
    dec_slots: torch.Tensor | None = None  # [D * Lmax] cache rows of each decode request's context
    dec_len: int = 0  # Lmax
    dec_mask: torch.Tensor | None = None  # [D, 1, 1, Lmax] True where a key is real
    pf_q_index: torch.Tensor | None = None  # [P, Qmax] index into the prefill tokens (padded)
    pf_q_valid: torch.Tensor | None = None  # [P, Qmax]
    pf_slots: torch.Tensor | None = None  # [P * Kmax]
    pf_len: int = 0  # Kmax
    pf_mask: torch.Tensor | None = None  # [P, 1, Qmax, Kmax] causal and length mask


def _table_tensor(slices: list[SeqSlice], width: int) -> torch.Tensor:
    rows = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in slices]
    return torch.tensor(rows, dtype=torch.long)


def build_metadata(decode: list[SeqSlice], prefill: list[SeqSlice], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    pos_list: list[int] = [s.start_pos for s in decode]
    for s in prefill:
        pos_list.extend(range(s.start_pos, s.start_pos + s.num_tokens))
    positions = torch.tensor(pos_list, dtype=torch.long)
    tables = _table_tensor(decode + prefill, max(len(s.block_table) for s in decode + prefill))
    # Row of `tables` that each new token belongs to.
    owner = torch.repeat_interleave(torch.arange(len(decode) + len(prefill)),
                                    torch.tensor([1] * len(decode) + [s.num_tokens for s in prefill]))
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(positions=positions, slots=slots, num_decode=len(decode))
    if decode:
        ctx = positions[: len(decode)] + 1
        lmax = int(ctx.max())
        kpos = torch.arange(lmax)
        meta.dec_slots = (tables[: len(decode)][:, kpos // block_size] * block_size + kpos % block_size).flatten()
        meta.dec_len = lmax
        meta.dec_mask = (kpos[None, :] < ctx[:, None]).view(len(decode), 1, 1, lmax)
    if prefill:
        qlens = torch.tensor([s.num_tokens for s in prefill])
        starts = torch.tensor([s.start_pos for s in prefill])
        qmax, kmax = int(qlens.max()), int((starts + qlens).max())
        qidx = torch.arange(qmax)
        offsets = torch.cumsum(qlens, 0) - qlens
        meta.pf_q_valid = qidx[None, :] < qlens[:, None]
        meta.pf_q_index = torch.where(meta.pf_q_valid, offsets[:, None] + qidx[None, :], 0)
        kpos = torch.arange(kmax)
        meta.pf_slots = (tables[len(decode):][:, kpos // block_size] * block_size + kpos % block_size).flatten()
        meta.pf_len = kmax
        qpos = starts[:, None] + qidx[None, :]  # [P, Qmax]
        mask = kpos[None, None, :] <= qpos[:, :, None]
        # Padded query rows see key 0 only, so softmax stays finite; their output is discarded.
        mask = torch.where(meta.pf_q_valid[:, :, None], mask, kpos[None, None, :] == 0)
        meta.pf_mask = mask.unsqueeze(1)
    if device.type != "cpu":
        for name, value in vars(meta).items():
            if isinstance(value, torch.Tensor):
                setattr(meta, name, value.to(device, non_blocking=True))
    return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_layer: [2, num_blocks, block_size, KVH, D] (a view).

    Writes the new K/V into their slots, then attends each token over its request's context.
    """
    kvh, hd = k.shape[1], k.shape[2]
    k_cache = kv_layer[0].view(-1, kvh, hd)
    v_cache = kv_layer[1].view(-1, kvh, hd)
    k_cache.index_copy_(0, meta.slots, k)
    v_cache.index_copy_(0, meta.slots, v)
    gqa = q.shape[1] != kvh
    d = meta.num_decode
    outs: list[torch.Tensor] = []
    if d:
        kd = k_cache.index_select(0, meta.dec_slots).view(d, meta.dec_len, kvh, hd).transpose(1, 2)
        vd = v_cache.index_select(0, meta.dec_slots).view(d, meta.dec_len, kvh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), kd, vd, attn_mask=meta.dec_mask,
                                           scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(2))
    if meta.pf_q_index is not None:
        p = meta.pf_q_index.shape[0]
        qp = q[d:][meta.pf_q_index].transpose(1, 2)  # [P, H, Qmax, D]
        kp = k_cache.index_select(0, meta.pf_slots).view(p, meta.pf_len, kvh, hd).transpose(1, 2)
        vp = v_cache.index_select(0, meta.pf_slots).view(p, meta.pf_len, kvh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.pf_mask, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2)[meta.pf_q_valid])
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
