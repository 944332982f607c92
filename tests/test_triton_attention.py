"""Paged Triton attention (tokenslice/model/triton_attention.py) against SDPA over the same pool.

On CPU the kernels run in Triton's interpreter, in a child process: TRITON_INTERPRET=1 must be set
before triton is first imported (triton.jit reads it when wrapping triton's own tl.sum, tl.cdiv...),
which this process may already have done, and it must not leak to other tests (triton_available()
reads it). The child runs every case once and hands back outputs and references. With a CUDA GPU
the same cases also run compiled in this process, and a decode call is captured in a CUDA graph
and replayed on new inputs.

Tolerances (max abs and rel error against an fp32 SDPA reference of the same inputs): fp32 1e-4;
fp16 3e-3 (the softmax weights enter the P·V product in fp16); bf16 2e-2 (an 8-bit mantissa on
the weights and on the output).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tokenslice.model.triton_attention import INTERPRETED, paged_decode_attention, paged_prefill_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOLERANCE = {F32: 1e-4, F16: 3e-3, BF16: 2e-2}
NUM_LAYERS = 2
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compiled Triton kernels need a CUDA GPU (the interpreter runs them here)")


def make_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, seed: int) -> torch.Tensor:
    """A whole random KV pool [layers, 2, blocks, block_size, KVH, hd]: slots past a row's context hold noise."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_LAYERS, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)


def make_tables(context_lens: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Shuffled, non-contiguous blocks for each row, one spare column; unused columns hold other real blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens) + 1
    return torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in context_lens]).to(torch.int32)


def make_queries(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 seed: int) -> torch.Tensor:
    """q as the runner holds it: the first H heads of a packed qkv projection (a strided view)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads + 4, head_dim, generator=gen).to(device, dtype)[:, :heads]


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
              context_len: int, scale: float) -> torch.Tensor:
    """SDPA in fp32 for one sequence: its last len(q) positions attend causally to its context
    (none: a padding row, whose output is zeros)."""
    if context_len == 0:
        return torch.zeros(q.shape, dtype=torch.float32)
    block_size = k_cache.shape[1]
    pos = torch.arange(context_len)
    blocks = table.cpu().long()[pos // block_size]
    k = k_cache.cpu()[blocks, pos % block_size].float().transpose(0, 1)  # [KVH, ctx, hd]
    v = v_cache.cpu()[blocks, pos % block_size].float().transpose(0, 1)
    q_pos = context_len - q.shape[0] + torch.arange(q.shape[0])
    mask = pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.cpu().float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


# What a case hands back: the kernel's output (on CPU), the SDPA reference, whether the pool is untouched.
Outcome = tuple[torch.Tensor, torch.Tensor, bool]

# (dtype, block_size, heads, kv_heads, head_dim, context_lens, num_splits): lengths cover 1 key, a
# partial last block, exactly one block and several, and 0 (a CUDA graph's padding row); 9/3
# heads of 64 are SmolLM2-135M's.
DECODE_CASES = [
    (F32, 16, 9, 3, 64, [1, 7, 16, 33, 70, 0], 1),
    (F32, 16, 9, 3, 64, [1, 7, 16, 33, 70, 0], 3),  # split-K, rows shorter than the splits included
    (F32, 16, 8, 1, 64, [1, 300], None),  # a 512-key table: the shape heuristic splits
    (F32, 32, 4, 4, 32, [32, 45, 1], 1),
    (F32, 8, 8, 1, 128, [9, 50], 2),
    (BF16, 32, 9, 3, 64, [1, 40, 100], None),
    (F16, 16, 16, 2, 64, [5, 64], 2),
]

# (dtype, block_size, heads, kv_heads, head_dim, [(cached_prefix, new_tokens) per sequence]): a whole
# prompt from position 0 spanning two 64-query tiles, an extend of a cached prefix, a chunk in the
# middle of a prompt (later slots of its blocks hold noise), single tokens.
PREFILL_CASES = [
    (F32, 16, 9, 3, 64, [(0, 70), (20, 5), (33, 16), (0, 1)]),
    (F32, 32, 4, 4, 32, [(31, 1), (0, 33), (64, 30)]),
    (F32, 16, 8, 1, 64, [(10, 20)]),
    (BF16, 16, 9, 3, 64, [(0, 40), (17, 12)]),
    (F16, 32, 9, 3, 64, [(5, 27), (0, 9)]),
]


def run_decode(case: tuple, device: torch.device) -> Outcome:
    dtype, block_size, heads, kv_heads, head_dim, context_lens, num_splits = case
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 8
    tables = make_tables(context_lens, block_size, num_blocks, seed=1)
    if max(context_lens) > 256:  # widen the table to 512 keys
        tables = torch.cat([tables, tables[:, :1].expand(-1, 512 // block_size - tables.shape[1])], 1)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=2)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    before = pool.clone()
    q = make_queries(len(context_lens), heads, head_dim, dtype, device, seed=3)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables.to(device),
                                 torch.tensor(context_lens, dtype=torch.int32, device=device), scale,
                                 num_splits=num_splits)
    expected = torch.cat([reference(q[i:i + 1], k_cache, v_cache, tables[i], n, scale)
                          for i, n in enumerate(context_lens)])
    return out.cpu(), expected, torch.equal(pool, before)


def run_prefill(case: tuple, device: torch.device) -> Outcome:
    dtype, block_size, heads, kv_heads, head_dim, chunks = case
    context_lens = [cached + new for cached, new in chunks]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 8
    tables = make_tables(context_lens, block_size, num_blocks, seed=4)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=5)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    before = pool.clone()
    qlens = torch.tensor([new for _, new in chunks])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).tolist()
    q = make_queries(starts[-1], heads, head_dim, dtype, device, seed=6)
    out = torch.full_like(q, float("nan"))  # preallocated: every row must be written
    scale = head_dim ** -0.5
    result = paged_prefill_attention(q, k_cache, v_cache, tables.to(device),
                                     torch.tensor(starts, dtype=torch.int32, device=device),
                                     torch.tensor(context_lens, dtype=torch.int32, device=device), scale, out=out)
    assert result is out
    expected = torch.cat([reference(q[starts[p]:starts[p + 1]], k_cache, v_cache, tables[p], context_lens[p], scale)
                          for p in range(len(chunks))])
    return out.cpu(), expected, torch.equal(pool, before)


class ScalarReads(TorchDispatchMode):
    """Records the operators that copy a tensor's value to the host (.item(), int(), .tolist(), .cpu())."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def scalar_reads_of_calls() -> list[str]:
    """The host reads of tensor values made by one decode (split) and one prefill call, kernels included."""
    pool = make_pool(8, 16, 1, 32, F32, CPU, seed=7)
    tables = make_tables([20, 5], 16, 8, seed=8)
    context_lens = torch.tensor([20, 5], dtype=torch.int32)
    q = make_queries(2, 2, 32, F32, CPU, seed=9)
    with ScalarReads() as reads:
        paged_decode_attention(q, pool[0, 0], pool[0, 1], tables, context_lens, 0.2, num_splits=2)
        paged_prefill_attention(q, pool[0, 0], pool[0, 1], tables, torch.tensor([0, 1, 2], dtype=torch.int32),
                                context_lens, 0.2)
    return reads.seen


def run_interpreted(path: str) -> None:
    """The child's work: every case on CPU under the interpreter, saved for the parent to check."""
    assert INTERPRETED, "TRITON_INTERPRET=1 must be set before triton is imported"
    results: dict[str, object] = {"scalar_reads": scalar_reads_of_calls()}
    for i, case in enumerate(DECODE_CASES):
        results[f"decode{i}"] = run_decode(case, CPU)
    for i, case in enumerate(PREFILL_CASES):
        results[f"prefill{i}"] = run_prefill(case, CPU)
    torch.save(results, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import {Path(__file__).stem} as t; t.run_interpreted({str(path)!r})"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=here.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


def check(outcome: Outcome, dtype: torch.dtype) -> None:
    out, expected, untouched = outcome
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert untouched, "the kernel wrote to the KV pool"


def case_id(case: tuple) -> str:
    return "-".join(str(part).replace("torch.", "").replace(" ", "") for part in case)


@pytest.mark.parametrize("index", range(len(DECODE_CASES)), ids=[case_id(c) for c in DECODE_CASES])
def test_decode_interpreted_matches_sdpa(interpreted: dict[str, object], index: int) -> None:
    check(interpreted[f"decode{index}"], DECODE_CASES[index][0])


@pytest.mark.parametrize("index", range(len(PREFILL_CASES)), ids=[case_id(c) for c in PREFILL_CASES])
def test_prefill_interpreted_matches_sdpa(interpreted: dict[str, object], index: int) -> None:
    check(interpreted[f"prefill{index}"], PREFILL_CASES[index][0])


def test_calls_read_no_tensor_values_on_the_host(interpreted: dict[str, object]) -> None:
    """A CUDA graph replays kernels only: the wrappers size everything from shapes, never from
    values; under the interpreter the whole call (wrapper and kernels) reads no scalar out of a tensor."""
    assert interpreted["scalar_reads"] == []


def test_module_imports_and_reports_without_triton() -> None:
    """Where triton is missing the module still imports, and says the kernels cannot run."""
    code = ("import sys; sys.modules['triton'] = None; "
            "from tokenslice.model.triton_attention import triton_available; assert not triton_available()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@needs_cuda
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_compiled_matches_sdpa(case: tuple) -> None:
    check(run_decode(case, torch.device("cuda")), case[0])


@needs_cuda
@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_prefill_compiled_matches_sdpa(case: tuple) -> None:
    check(run_prefill(case, torch.device("cuda")), case[0])


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_replays_in_a_cuda_graph(num_splits: int) -> None:
    """Captured once with placeholder inputs, replayed after new lengths, tables and queries are copied in."""
    dev, block_size, heads, kv_heads, head_dim = torch.device("cuda"), 16, 9, 3, 64
    pool = make_pool(64, block_size, kv_heads, head_dim, BF16, dev, seed=10)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    q = torch.zeros(4, heads, head_dim, dtype=BF16, device=dev)
    tables = torch.zeros(4, 16, dtype=torch.int32, device=dev)
    context_lens = torch.ones(4, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def step() -> None:
        paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125, out, num_splits=num_splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens = [1, 17, 100, 190]
    new_tables = make_tables(lens, block_size, 64, seed=11)
    tables[:, :new_tables.shape[1]].copy_(new_tables)
    context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    q.copy_(make_queries(4, heads, head_dim, BF16, dev, seed=12))
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.cat([reference(q[i:i + 1], k_cache, v_cache, tables[i], n, 0.125) for i, n in enumerate(lens)])
    check((out.cpu(), expected, True), BF16)
