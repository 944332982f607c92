"""Paged attention over block tables, for decode (one new token) and prefill (many).

KV layout, one tensor for the whole pool: [num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]. A block holds every layer's K and V for its tokens contiguously, so moving a
block between tiers, or a run of adjacent blocks, is a single copy.
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
    slot_blocks: torch.Tensor  # [T] block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode: int
    dec_blocks: torch.Tensor | None = None  # [D, Lmax] blocks of each decode request's context
    dec_offsets: torch.Tensor | None = None
    dec_mask: torch.Tensor | None = None  # [D, 1, 1, Lmax] True where a key is real
    pf_q_index: torch.Tensor | None = None  # [P, Qmax] index into the prefill tokens (padded)
    pf_q_valid: torch.Tensor | None = None  # [P, Qmax]
    pf_blocks: torch.Tensor | None = None  # [P, Kmax]
    pf_offsets: torch.Tensor | None = None
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
    slot_blocks = tables[owner, positions // block_size]
    meta = AttentionMetadata(positions=positions, slot_blocks=slot_blocks,
                             slot_offsets=positions % block_size, num_decode=len(decode))
    if decode:
        ctx = positions[: len(decode)] + 1
        lmax = int(ctx.max())
        kpos = torch.arange(lmax)
        meta.dec_blocks = tables[: len(decode)][:, kpos // block_size]
        meta.dec_offsets = (kpos % block_size).expand(len(decode), lmax)
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
        meta.pf_blocks = tables[len(decode):][:, kpos // block_size]
        meta.pf_offsets = (kpos % block_size).expand(len(prefill), kmax)
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
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_layer: [num_blocks, 2, block_size, KVH, D] (a view).

    Writes the new K/V into their slots, then attends each token over its request's context.
    """
    k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    gqa = q.shape[1] != k.shape[1]
    d = meta.num_decode
    outs: list[torch.Tensor] = []
    if d:
        kd = k_cache[meta.dec_blocks, meta.dec_offsets].transpose(1, 2)  # [D, KVH, L, D]
        vd = v_cache[meta.dec_blocks, meta.dec_offsets].transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), kd, vd, attn_mask=meta.dec_mask,
                                           scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(2))
    if meta.pf_q_index is not None:
        qp = q[d:][meta.pf_q_index].transpose(1, 2)  # [P, H, Qmax, D]
        kp = k_cache[meta.pf_blocks, meta.pf_offsets].transpose(1, 2)
        vp = v_cache[meta.pf_blocks, meta.pf_offsets].transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.pf_mask, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2)[meta.pf_q_valid])
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
