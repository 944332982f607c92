"""Paged attention kernels in Triton: queries read K/V in place from the KV pool through block tables.

The SDPA path (attention.py) gathers each row's whole context out of the pool into a dense
tensor every step, then attends; these kernels skip the copy. A program walks its row's key
positions in tiles of BLOCK_N, looks each position's block up in the row's block table and loads
K/V straight from the pool ([num_blocks, block_size, kv_heads, head_dim] per layer), keeping a
running max and sum (online softmax, FlashAttention-2 / flash-decoding) so scores are never stored.

- paged_decode_attention: one query per row. A program serves one (row, KV head) and all the
  query heads sharing it (GQA), padded to 16 rows for tl.dot. Long contexts with few rows can be
  split over several programs (split-K, flash-decoding) whose partial results a second kernel merges.
  Launch shapes depend only on tensor shapes and the loop bound is loaded from context_lens, so
  the call can be captured in a CUDA graph.
- paged_prefill_attention: packed queries of several sequences (prefill, extend, chunked
  prefill), each attending causally to its cached prefix and itself. A program serves BLOCK_M
  queries of one head; programs find their sequence by binary search over query_start_loc, so
  the grid depends only on the token and sequence counts.

Any block size works (a power of two makes the position-to-block lookup a shift); head_dim is a
power of two >= 16; H a multiple of KVH. Accumulation is in fp32; outputs have q's dtype. Triton is imported defensively, so this module
imports where it is missing (triton_available() then says False). With TRITON_INTERPRET=1 set before
triton is imported, the kernels run on CPU tensors in Triton's interpreter: how the tests check them.
"""
from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels below stay plain functions; triton_available() says False
    triton = None
    tl = None

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e)), one cheaper instruction
MIN_DOT = 16  # tl.dot needs each dimension >= 16
# Tiles, warps and stages: the fastest of a sweep on an H200 (bf16, head_dim 64, 9/3 heads);
# a key tile of 16 KiB (128 keys of 64 bf16 dims; fewer for wider heads or fp32, so that K and V
# tiles of every stage stay within shared memory).
KEY_TILE_BYTES = 16384
MAX_BLOCK_N = 128
PREFILL_BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 3  # software-pipelined loads in the key loop (Triton's default on Hopper)
SPLIT_TARGET_PROGRAMS = 512  # about four waves of an H100's or H200's 132 SMs
SPLIT_MIN_TOKENS = 256  # fewer keys per split than this cost more in merging than they gain
MAX_SPLITS = 16


# triton.jit reads TRITON_INTERPRET when it wraps a function, its own library's (tl.sum, tl.cdiv)
# at `import triton`: the interpreter runs these kernels only if it was set before that import.
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)
_jit = triton.jit if triton is not None else (lambda fn: fn)


def triton_available() -> bool:
    """Whether these kernels can run here: triton imports, and a CUDA device or the interpreter."""
    return triton is not None and (torch.cuda.is_available() or bool(triton.knobs.runtime.interpret))


@_jit
def _attend_tile(q, K, V, table, pos, valid, visible, kvh, m_i, l_i, acc, scale_log2,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d,
                 BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One tile of key positions `pos` (`valid` ones exist, `visible` [queries, keys] ones are
    attended): K and V loaded in place through the block `table`, folded into the online softmax
    (running max m_i, sum l_i, output acc). Returns the updated (m_i, l_i, acc)."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k = tl.load(K + block[None, :] * stride_kb + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                mask=valid[None, :], other=0.0).to(DOT_DTYPE)  # [HEAD_DIM, BLOCK_N]
    s = tl.dot(q, k, input_precision="ieee") * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + block[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=valid[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_DIM]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return m_new, l_i, acc


@_jit
def _decode_kernel(Q, K, V, BT, CTX, O, PART_O, PART_LSE, scale_log2,
                   stride_qd, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_bt, stride_od, stride_oh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + row)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(Q + row * stride_qd + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = BT + row.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        m_i, l_i, acc = _attend_tile(q, K, V, table, pos, valid, valid[None, :], kvh, m_i, l_i, acc, scale_log2,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d,
                                     BLOCK_SIZE, DOT_DTYPE)
    # A split with no keys (a short row, or a padding row of 0 keys) holds zeros and lse = -inf,
    # so the merge gives it no weight.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(O + row * stride_od + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [D, H, S] index
        tl.store(PART_O + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(PART_LSE + part, lse, mask=g_mask)


@_jit
def _merge_splits_kernel(PART_O, PART_LSE, O, stride_od, stride_oh, NUM_HEADS: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(PART_LSE + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all -inf: a row of 0 keys
    part = tl.load(PART_O + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=(offs_s < NUM_SPLITS)[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + row * stride_od + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


@_jit
def _prefill_kernel(Q, K, V, BT, QSL, CTX, O, scale_log2, num_seqs,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    qblock = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    # Sequence p owns query blocks from QSL[p] // BLOCK_M + p on (an upper bound that keeps
    # the grid a function of shapes): find the last p whose first block is <= this one.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QSL + mid) // BLOCK_M + mid <= qblock:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    m_block = qblock - (q_start // BLOCK_M + seq)
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(CTX + seq)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence's chunk
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    q_pos = ctx - q_len + offs_m  # each query's position; it sees keys 0..q_pos
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = BT + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(ctx, ctx - q_len + (m_block + 1) * BLOCK_M)  # past the block's last query
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < kv_end
        # Key 0 is in every query's first tile, so the running max is finite from there on.
        m_i, l_i, acc = _attend_tile(q, K, V, table, pos, valid, valid[None, :] & (pos[None, :] <= q_pos[:, None]),
                                     kvh, m_i, l_i, acc, scale_log2, stride_kb, stride_kt, stride_kh, stride_vb,
                                     stride_vt, stride_vh, offs_d, BLOCK_SIZE, DOT_DTYPE)
    out = acc / l_i[:, None]
    tl.store(O + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None])


def _dot_dtype(dtype: torch.dtype) -> Any:
    """The dtype tiles enter tl.dot in: the storage one, except bf16 under the interpreter,
    whose numpy matmul would read bf16's raw bits as integers."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRETED else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Shape checks only (host metadata, no device sync)."""
    assert triton is not None, "triton is not installed"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, "caches: [num_blocks, block_size, KVH, hd]"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert q.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of KV heads"
    hd = q.shape[-1]
    assert hd == k_cache.shape[3] and hd >= MIN_DOT and hd & (hd - 1) == 0, "head_dim: a power of two >= 16"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.dtype == k_cache.dtype == v_cache.dtype
    assert block_tables.dtype == torch.int32


def _key_tile(q: torch.Tensor) -> int:
    """Keys per tile (BLOCK_N): a power of two, 16 to MAX_BLOCK_N, about KEY_TILE_BYTES of K."""
    return max(MIN_DOT, min(MAX_BLOCK_N, KEY_TILE_BYTES // (q.shape[-1] * q.element_size())))


def _decode_splits(rows: int, kv_heads: int, max_tokens: int) -> int:
    """Split-K count from shapes alone (graph-safe): enough programs for about one wave of SMs,
    each split keeping at least SPLIT_MIN_TOKENS keys of the longest context the table can hold."""
    want = -(-SPLIT_TARGET_PROGRAMS // max(1, rows * kv_heads))
    return max(1, min(want, max_tokens // SPLIT_MIN_TOKENS, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None) -> torch.Tensor:
    """One query per row over its context_lens[row] cached keys (the row's own K/V included).

    q: [D, H, hd]; k_cache, v_cache: [num_blocks, block_size, KVH, hd]; block_tables: [D, W] int32;
    context_lens: [D] int32 (a padding row of 0 keys gets zeros). Returns [D, H, hd] in q's dtype
    (into `out` if given).
    num_splits: split-K programs per (row, KV head); None picks from the shapes.
    """
    _check(q, k_cache, v_cache, block_tables)
    assert context_lens.dtype == torch.int32
    rows, heads, hd = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if rows == 0:
        return out
    group = heads // kv_heads
    splits = num_splits or _decode_splits(rows, kv_heads, block_tables.shape[1] * block_size)
    if splits > 1:
        part_o = torch.empty(rows, heads, splits, hd, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=_key_tile(q),
        HEAD_DIM=hd, BLOCK_SIZE=block_size, NUM_SPLITS=splits, DOT_DTYPE=_dot_dtype(q.dtype), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if splits > 1:
        _merge_splits_kernel[(rows, heads)](part_o, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=heads,
                                            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=hd,
                                            num_warps=NUM_WARPS)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of P packed query chunks over their cached contexts (prefill, extend, chunked).

    q: [T, H, hd], sequence p's queries at rows query_start_loc[p]:query_start_loc[p + 1] (int32 [P + 1]);
    context_lens[p] (int32 [P]) keys of sequence p are in the cache, these queries' own included, so its
    query i sits at position context_lens[p] - qlen_p + i. block_tables: [P, W] int32. Returns [T, H, hd].
    """
    _check(q, k_cache, v_cache, block_tables)
    assert context_lens.dtype == query_start_loc.dtype == torch.int32
    tokens, heads, hd = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if tokens == 0:
        return out
    _prefill_kernel[(tokens // PREFILL_BLOCK_M + num_seqs, heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=_key_tile(q), HEAD_DIM=hd,
        BLOCK_SIZE=block_size, DOT_DTYPE=_dot_dtype(q.dtype), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out
