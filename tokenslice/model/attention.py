"""Paged attention over block tables, for decode (one new token) and prefill (many).

KV layout, one tensor for the whole pool: [num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]. Each layer's K (and V) is contiguous, so token slots are rows of a flat
[num_blocks * block_size, kv_heads * head_dim] view and a context gather is one
index_select (per-token advanced indexing on a block-major layout was half the step time).
A run of adjacent blocks is still one strided copy across all layers when it moves tiers.

Two backends. "sdpa" gathers each row's context out of the pool into a dense tensor and runs
PyTorch's SDPA on it (the CPU path: its gathers and SDPA are the fastest kernels there).
"triton" reads K/V in place through the block tables (model/triton_attention.py, as vLLM's
and SGLang's paged kernels do): no per-step copy of the live KV, and on CUDA one graph per batch
size serves every context length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenslice.model.input_batch import DecodeInputs, decode_inputs
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
    # A decode-only step run compiled: attention goes through the opaque decode_attention op.
    opaque_decode: bool = False
    # A decode-only step run by torch.compile: the pool is only read (dec_slots is [D, Lmax]) and
    # each layer's new [2, D, KVH, hd] K/V is appended here, for the caller to write after the step.
    new_kv: list[torch.Tensor] | None = None
    # The "triton" backend's inputs (the gathers above stay None): block tables and key counts.
    triton: bool = False
    dec_tables: torch.Tensor | None = None  # [D, W] int32
    dec_lens: torch.Tensor | None = None  # [D] int32, keys of each decode row (its position + 1)
    pf_tables: torch.Tensor | None = None  # [P, W] int32
    pf_query_start: torch.Tensor | None = None  # [P + 1] int32, offsets of each slice's tokens
    pf_lens: torch.Tensor | None = None  # [P] int32, keys of each slice (cached prefix + its tokens)


def resolve_attention_backend(name: str, device: torch.device, head_dim: int) -> str:
    """auto: triton on CUDA where Triton imports and the kernels take the head size (a power of two
    >= 16), else sdpa. triton elsewhere only under Triton's interpreter (TRITON_INTERPRET=1),
    which checks the kernels on CPU but is far too slow to serve."""
    from tokenslice.model.triton_attention import triton_available

    fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() and fits else "sdpa"
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton' needs the triton package and a CUDA device "
                             "(or TRITON_INTERPRET=1 to check the kernels on CPU); use --attention-backend sdpa")
        if not fits:
            raise ValueError(f"attention backend 'triton' needs a head size that is a power of two >= 16, "
                             f"this model's is {head_dim}; use --attention-backend sdpa")
        return name
    if name != "sdpa":
        raise ValueError(f"attention backend must be auto, triton or sdpa, got {name!r}")
    return name


def decode_slots(dec: DecodeInputs, block_size: int) -> np.ndarray:
    """The cache row (block * block_size + offset) each decode row's new token is written to."""
    pos = dec.positions
    return dec.tables[np.arange(len(pos)), pos // block_size] * block_size + pos % block_size


def _table_tensor(slices: list[SeqSlice], width: int) -> torch.Tensor:
    rows = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in slices]
    return torch.tensor(rows, dtype=torch.long)


def build_metadata(decode: list[SeqSlice], prefill: list[SeqSlice], block_size: int,
                   device: torch.device, backend: str = "sdpa") -> AttentionMetadata:
    """Metadata built from the plan alone (one-off passes; the runner keeps a DecodeBatch)."""
    return step_metadata(decode_inputs(decode), prefill, block_size, device, backend=backend)


def step_metadata(dec: DecodeInputs, prefill: list[SeqSlice], block_size: int,
                  device: torch.device, ctx_len: int = 0, backend: str = "sdpa") -> AttentionMetadata:
    """Metadata of a step: the decode rows (`dec`, plan order) first, then the prefill slices.
    `ctx_len`: gather at least this many keys per decode row (shape buckets; the mask hides them)."""
    if backend == "triton":
        return _to_device(_paged_metadata(dec, prefill, block_size), device)
    num_decode = len(dec.positions)
    dec_pos = torch.from_numpy(dec.positions)
    positions, slots = dec_pos, dec_pos  # replaced below; the decode part always comes first
    meta = AttentionMetadata(positions=positions, slots=slots, num_decode=num_decode)
    if num_decode:
        # In numpy: on these few-element arrays each torch op costs several times more (dispatch).
        pos, tables = dec.positions, dec.tables
        slots = torch.from_numpy(decode_slots(dec, block_size))
        lmax = max(int(pos.max()) + 1, ctx_len)
        kpos = np.arange(lmax)
        meta.dec_slots = torch.from_numpy((tables[:, kpos // block_size] * block_size + kpos % block_size).reshape(-1))
        meta.dec_len = lmax
        meta.dec_mask = torch.from_numpy((kpos[None, :] < pos[:, None] + 1).reshape(num_decode, 1, 1, lmax))
    if prefill:
        pos_list: list[int] = []
        for s in prefill:
            pos_list.extend(range(s.start_pos, s.start_pos + s.num_tokens))
        pf_pos = torch.tensor(pos_list, dtype=torch.long)
        tables = _table_tensor(prefill, max(len(s.block_table) for s in prefill))
        qlens = torch.tensor([s.num_tokens for s in prefill])
        owner = torch.repeat_interleave(torch.arange(len(prefill)), qlens)  # each token's row
        pf_slots = tables[owner, pf_pos // block_size] * block_size + pf_pos % block_size
        positions = torch.cat([dec_pos, pf_pos]) if num_decode else pf_pos
        slots = torch.cat([slots, pf_slots]) if num_decode else pf_slots
        starts = torch.tensor([s.start_pos for s in prefill])
        qmax, kmax = int(qlens.max()), int((starts + qlens).max())
        qidx = torch.arange(qmax)
        offsets = torch.cumsum(qlens, 0) - qlens
        meta.pf_q_valid = qidx[None, :] < qlens[:, None]
        meta.pf_q_index = torch.where(meta.pf_q_valid, offsets[:, None] + qidx[None, :], 0)
        kpos = torch.arange(kmax)
        meta.pf_slots = (tables[:, kpos // block_size] * block_size + kpos % block_size).flatten()
        meta.pf_len = kmax
        qpos = starts[:, None] + qidx[None, :]  # [P, Qmax]
        mask = kpos[None, None, :] <= qpos[:, :, None]
        # Padded query rows see key 0 only, so softmax stays finite; their output is discarded.
        mask = torch.where(meta.pf_q_valid[:, :, None], mask, kpos[None, None, :] == 0)
        meta.pf_mask = mask.unsqueeze(1)
    meta.positions, meta.slots = positions, slots
    return _to_device(meta, device)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type != "cpu":
        for name, value in vars(meta).items():
            if isinstance(value, torch.Tensor):
                setattr(meta, name, value.to(device, non_blocking=True))
    return meta


def _paged_metadata(dec: DecodeInputs, prefill: list[SeqSlice], block_size: int) -> AttentionMetadata:
    """The triton backend's metadata: positions and slots of the new tokens, and each row's block
    table and key count; the kernels read the context in place."""
    num_decode = len(dec.positions)
    positions, slots = [dec.positions], [decode_slots(dec, block_size)]
    meta = AttentionMetadata(positions=torch.empty(0), slots=torch.empty(0), num_decode=num_decode, triton=True)
    if num_decode:
        meta.dec_tables = torch.from_numpy(dec.tables.astype(np.int32))
        meta.dec_lens = torch.from_numpy((dec.positions + 1).astype(np.int32))
    if prefill:
        width = max(len(s.block_table) for s in prefill)
        pf_tables = np.zeros((len(prefill), width), dtype=np.int64)
        for i, s in enumerate(prefill):
            pf_tables[i, :len(s.block_table)] = s.block_table
            p = np.arange(s.start_pos, s.start_pos + s.num_tokens)
            positions.append(p)
            slots.append(pf_tables[i, p // block_size] * block_size + p % block_size)
        qlens = np.array([s.num_tokens for s in prefill], dtype=np.int32)
        meta.pf_tables = torch.from_numpy(pf_tables.astype(np.int32))
        meta.pf_query_start = torch.from_numpy(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32))
        meta.pf_lens = torch.from_numpy(np.array([s.start_pos + s.num_tokens for s in prefill], dtype=np.int32))
    meta.positions = torch.from_numpy(np.concatenate(positions).astype(np.int64))
    meta.slots = torch.from_numpy(np.concatenate(slots).astype(np.int64))
    return meta


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec_slots: torch.Tensor,
                      dec_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Each decode row's one query over its context; caches are [slots, KVH, D] views."""
    d, lmax = dec_mask.shape[0], dec_mask.shape[-1]
    kvh, hd = k_cache.shape[1], k_cache.shape[2]
    kd = k_cache.index_select(0, dec_slots).view(d, lmax, kvh, hd).transpose(1, 2)
    vd = v_cache.index_select(0, dec_slots).view(d, lmax, kvh, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=dec_mask, scale=scale,
                                       enable_gqa=q.shape[1] != kvh)
    return o.squeeze(2)


@torch.library.custom_op("tokenslice::decode_attention", mutates_args=("kv_layer",))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                     slots: torch.Tensor, dec_slots: torch.Tensor, dec_mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A decode-only step's cache write and attention as one opaque operator for torch.compile:
    traced as plain ops, the in-place write into the whole KV pool would become a functional
    copy of the pool every step."""
    kvh, hd = k.shape[1], k.shape[2]
    k_cache, v_cache = kv_layer[0].view(-1, kvh, hd), kv_layer[1].view(-1, kvh, hd)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return _decode_attention(q, k_cache, v_cache, dec_slots, dec_mask, scale)


@decode_attention.register_fake
def _decode_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                            slots: torch.Tensor, dec_slots: torch.Tensor, dec_mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def traced_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention for torch.compile's graphs: each row's context gathered from the pool
    through its slots, with the row's new K/V put in place of the stale slot at its position.
    Nothing is written to the pool, so the graph has no mutation and stays whole (the caller
    writes meta.new_kv after the step). One row runs as two small matmuls, several through SDPA:
    the faster of each on the CPUs measured (docs/benchmarks/decode-speed-and-llamacpp.md, "Compiled decode that only reads the KV pool")."""
    assert meta.new_kv is not None and meta.dec_slots is not None
    meta.new_kv.append(torch.stack([k, v]))
    d, kvh, hd = k.shape
    g = q.shape[1] // kvh
    rows = torch.arange(d)
    k_ctx = kv_layer[0].view(-1, kvh, hd)[meta.dec_slots].index_put((rows, meta.positions), k)  # [D, L, KVH, hd]
    v_ctx = kv_layer[1].view(-1, kvh, hd)[meta.dec_slots].index_put((rows, meta.positions), v)
    visible = torch.arange(meta.dec_slots.shape[1]) <= meta.positions[:, None]  # [D, L]
    if d == 1:
        scores = torch.matmul(q.view(kvh, g, hd) * scale, k_ctx[0].permute(1, 2, 0))  # [KVH, G, L]
        out = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v_ctx[0].transpose(0, 1))
        return out.reshape(1, kvh * g, hd)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                                       attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=g != 1)
    return o.squeeze(2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_layer: [2, num_blocks, block_size, KVH, D] (a view).

    Writes the new K/V into their slots, then attends each token over its request's context.
    """
    if meta.new_kv is not None:
        return traced_decode_attention(q, k, v, kv_layer, meta, scale)
    if meta.opaque_decode:
        return decode_attention(q, k, v, kv_layer, meta.slots, meta.dec_slots, meta.dec_mask, scale)
    kvh, hd = k.shape[1], k.shape[2]
    k_cache = kv_layer[0].view(-1, kvh, hd)
    v_cache = kv_layer[1].view(-1, kvh, hd)
    k_cache.index_copy_(0, meta.slots, k)
    v_cache.index_copy_(0, meta.slots, v)
    if meta.triton:
        return _triton_paged_attention(q, kv_layer, meta, scale)
    gqa = q.shape[1] != kvh
    d = meta.num_decode
    outs: list[torch.Tensor] = []
    if d:
        outs.append(_decode_attention(q[:d], k_cache, v_cache, meta.dec_slots, meta.dec_mask, scale))
    if meta.pf_q_index is not None:
        p = meta.pf_q_index.shape[0]
        qp = q[d:][meta.pf_q_index].transpose(1, 2)  # [P, H, Qmax, D]
        kp = k_cache.index_select(0, meta.pf_slots).view(p, meta.pf_len, kvh, hd).transpose(1, 2)
        vp = v_cache.index_select(0, meta.pf_slots).view(p, meta.pf_len, kvh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.pf_mask, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2)[meta.pf_q_valid])
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def _triton_paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """Attend in place through the block tables (no gather); the new K/V are already written."""
    from tokenslice.model.triton_attention import paged_decode_attention, paged_prefill_attention

    k_cache, v_cache = kv_layer[0], kv_layer[1]
    d = meta.num_decode
    outs: list[torch.Tensor] = []
    if d:
        outs.append(paged_decode_attention(q[:d], k_cache, v_cache, meta.dec_tables, meta.dec_lens, scale))
    if meta.pf_tables is not None:
        outs.append(paged_prefill_attention(q[d:], k_cache, v_cache, meta.pf_tables, meta.pf_query_start,
                                            meta.pf_lens, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
