"""Compiled decode: a decode-only step (forward + LM head) run as compiled code instead of
op-by-op eager PyTorch, whose per-operator dispatch dominates small models' steps.

- CPU: torch.compile (inductor's C++/OpenMP kernels), two graphs compiled at start-up: one for
  a batch of 1, one for any larger batch (the row count a dynamic dimension; not for models
  whose linears are oneDNN-packed, whose multi-row steps run faster eager). The context length
  is dynamic in both: no shape met later compiles again, and no row or key is padded beyond
  whole blocks. (Static shapes per bucket
  compiled again at every new context bucket: seconds mid-stream, and 4x slower steps behind
  serve on average. A batch dimension of size 1 would be specialized, hence its own graph.)
- CUDA: CUDA graphs captured at start-up and replayed with the step's inputs copied into static
  buffers (vLLM's decode graphs), the batch padded to a power of two by repeating row 0 (whose
  K/V write then lands twice in the same slot with the same value). With the triton attention
  backend the kernels read each row's context in place up to its length, so one graph per
  batch bucket serves every context (block tables padded to the longest context). With sdpa
  the context is gathered, so there is a graph per batch and context bucket (a power of two
  blocks; the mask hides the padding). A step larger than every bucket runs eager.

Neither the compiler nor a graph may copy the KV pool. On CPU the graph only reads it: attention
(attention.traced_decode_attention) gathers each row's context through its slots, with the row's
own new K/V in place of its stale slot; the graph returns the new K/V and one index_copy_ then
writes them for all layers. A CUDA graph keeps the write and attention in one opaque operator
(attention.decode_attention). Mixed steps (prefill rows) always run eager.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from tokenslice.model.attention import AttentionMetadata, decode_slots, step_metadata
from tokenslice.model.input_batch import DecodeInputs
from tokenslice.model.layers import InputMajorLinear
from tokenslice.model.quant import QuantizedLinear

log = logging.getLogger("tokenslice.model.compiled_decode")


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to the first one covering `limit`."""
    out = [start]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def _traced_decode(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, dec_slots: torch.Tensor,
                   kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the step's new K/V, [layers, 2, D, KVH, hd]; the pool is only read."""
    meta = AttentionMetadata(positions=positions, slots=positions, num_decode=input_ids.shape[0],  # slots: unused
                             dec_slots=dec_slots, dec_len=dec_slots.shape[1], new_kv=[])
    logits = model.compute_logits(model(input_ids, meta, kv))
    return logits, torch.stack(meta.new_kv)


def _decode_logits(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   dec_slots: torch.Tensor, dec_mask: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    meta = AttentionMetadata(positions=positions, slots=slots, num_decode=input_ids.shape[0],
                             dec_slots=dec_slots, dec_len=dec_mask.shape[-1], dec_mask=dec_mask,
                             opaque_decode=True)
    return model.compute_logits(model(input_ids, meta, kv))


def _paged_decode_logits(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                         slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    meta = AttentionMetadata(positions=positions, slots=slots, num_decode=input_ids.shape[0], triton=True,
                             dec_tables=tables, dec_lens=lens)
    return model.compute_logits(model(input_ids, meta, kv))


class CompiledDecode:
    def __init__(self, model: nn.Module, kv: torch.Tensor, block_size: int, device: torch.device,
                 max_batch_size: int, max_model_len: int, backend: str = "sdpa") -> None:
        self.model, self.kv, self.block_size, self.device = model, kv, block_size, device
        self.backend = backend
        self.graphs: dict[tuple[int, int], _Graph | _PagedGraph] = {}
        self.multi_row = True  # a graph for steps of several rows as well
        self.batch_buckets = buckets(max_batch_size)
        # triton: one context "bucket", the longest (the kernels stop at each row's length).
        self.max_blocks = -(-max_model_len // block_size)
        self.ctx_buckets = ([self.max_blocks * block_size] if backend == "triton"
                            else buckets(max_model_len, block_size))
        if device.type == "cuda":
            t0 = time.perf_counter()
            self._capture_all()
            log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - t0)
        else:
            # Multi-row steps stay eager where oneDNN's packed linears serve them (layers.py): with
            # those GEMMs and eager SDPA the 24M Llama served 16 streams 10-20% faster than
            # compiled (docs/benchmarks/decode-speed-and-llamacpp.md, "Compiled decode"); one row is faster compiled everywhere.
            # Likewise quantized linears with a bf16 copy for many rows (model/quant.py): compiled
            # code would always take the packed kernel, whose cost grows with every row.
            self.multi_row = not any((isinstance(m, InputMajorLinear) and m.packed is not None)
                                     or (isinstance(m, QuantizedLinear) and m.dense is not None)
                                     for m in model.modules())
            log.info("compiling decode steps (torch.compile, at start-up only; --no-compile skips it)")
            t0 = time.perf_counter()
            # dynamic=False: only the dimensions _warm_up marks are dynamic.
            self._warm_up(torch.compile(self._traced, dynamic=False), max_batch_size if self.multi_row else 1)
            log.info("decode steps compiled in %.1f s", time.perf_counter() - t0)
            # From here on only those graphs run: a step they do not take runs eager instead of
            # compiling mid-stream, and no step pays for marking dimensions again.
            self._fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = torch._dynamo.run(self._traced)

    def _eager(self, *args: torch.Tensor) -> torch.Tensor:
        return _decode_logits(self.model, *args)

    def _traced(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _traced_decode(self.model, *args)

    def logits(self, dec: DecodeInputs) -> torch.Tensor | None:
        """[D, vocab] logits of a decode-only step, or None where no compiled shape fits it."""
        if self.device.type != "cuda":
            if len(dec.positions) > 1 and not self.multi_row:
                return None
            ids, positions, slots, dec_slots = self._inputs(dec)
            logits, new_kv = self._fn(ids, positions, dec_slots, self.kv)
            layers, _, blocks, bs, kvh, hd = self.kv.shape
            self.kv.view(layers, 2, blocks * bs, kvh, hd).index_copy_(2, slots, new_kv)
            return logits
        d, bs = len(dec.positions), self.block_size
        b = next((b for b in self.batch_buckets if b >= d), None)
        c = next((c for c in self.ctx_buckets if c > int(dec.positions.max())), None)
        if b is None or c is None:
            return None
        width = dec.tables.shape[1] if self.backend == "triton" else c // bs  # triton: no context padding
        return self.graphs[(b, c)].replay(_pad(dec, b, width), bs)[:d]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for c in reversed(self.ctx_buckets):  # largest first: later graphs reuse its memory
            for b in reversed(self.batch_buckets):
                g = (_PagedGraph(self, b, c // self.block_size, pool) if self.backend == "triton"
                     else _Graph(self, b, c, pool))
                pool = g.graph.pool()
                self.graphs[(b, c)] = g

    def _inputs(self, dec: DecodeInputs) -> tuple[torch.Tensor, ...]:
        bs, d = self.block_size, len(dec.positions)
        # Whole blocks of keys, at least 2 (a dynamic dimension of size 1 would be specialized).
        width = max(-(-(int(dec.positions.max()) + 1) // bs), -(-2 // bs))
        if dec.tables.shape[1] != width:
            dec = _pad(dec, d, width)
        meta = step_metadata(dec, [], bs, self.device, width * bs)
        assert meta.dec_slots is not None
        return torch.from_numpy(dec.token_ids), meta.positions, meta.slots, meta.dec_slots.view(d, width * bs)

    @torch.inference_mode()
    def _warm_up(self, compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]], max_batch_size: int) -> None:
        """Compile both graphs now, before any request: met mid-stream, a compilation (seconds)
        would stall every running request. The graphs write nothing."""
        for d in (1, 2)[:max_batch_size]:
            ids, positions, _slots, dec_slots = self._inputs(
                DecodeInputs(np.zeros(d, dtype=np.int64), np.ones(d, dtype=np.int64), np.zeros((d, 1), dtype=np.int64)))
            for t in (ids, positions, dec_slots) if d > 1 else ():  # the rows
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(dec_slots, 1)  # the keys
            compiled(ids, positions, dec_slots, self.kv)


def _pad(dec: DecodeInputs, rows: int, width: int) -> DecodeInputs:
    """`rows` rows (row 0 repeated) and `width` table columns (block 0 appended, or the columns
    past `width` dropped)."""
    idx = np.concatenate([np.arange(len(dec.positions)), np.zeros(rows - len(dec.positions), dtype=np.int64)])
    tables = np.zeros((rows, width), dtype=np.int64)
    w = min(width, dec.tables.shape[1])  # blocks past the context bucket are never read
    tables[:, :w] = dec.tables[idx, :w]
    return DecodeInputs(dec.token_ids[idx], dec.positions[idx], tables)


def _capture(graph: torch.cuda.CUDAGraph, fn: Callable[[], torch.Tensor], device: torch.device,
             pool: object | None) -> torch.Tensor:
    """Warm `fn` up on a side stream (allocator, kernel selection, Triton compilation), then
    capture it into `graph`; returns its static output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.cuda.graph(graph, pool=pool):
        return fn()


class _PagedGraph:
    """One captured decode step of `rows` rows with the triton backend: block tables of `width`
    columns and each row's key count are inputs, so it serves every context up to `width` blocks."""

    def __init__(self, owner: CompiledDecode, rows: int, width: int, pool: object | None) -> None:
        dev = owner.device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tables = torch.zeros(rows, width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(rows, dtype=torch.int32, device=dev)
        # Capture writes K/V to slot 0 (block 0) for the dummy rows; harmless before any request
        # runs, which is when graphs are captured.
        self.graph = torch.cuda.CUDAGraph()
        self.out = _capture(self.graph, lambda: _paged_decode_logits(
            owner.model, self.input_ids, self.positions, self.slots, self.tables, self.lens, owner.kv), dev, pool)

    def replay(self, dec: DecodeInputs, block_size: int) -> torch.Tensor:
        pos, tables = dec.positions, dec.tables
        slots = decode_slots(dec, block_size)
        # Only the columns in use move; those past them keep stale (valid) block ids that the
        # kernels never read, being past every row's length.
        for dst, src in ((self.input_ids, dec.token_ids), (self.positions, pos), (self.slots, slots),
                         (self.tables[:, :tables.shape[1]], tables.astype(np.int32)),
                         (self.lens, (pos + 1).astype(np.int32))):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        self.graph.replay()
        return self.out


class _Graph:
    """One captured decode step of `rows` rows over `ctx` keys, with its static inputs."""

    def __init__(self, owner: CompiledDecode, rows: int, ctx: int, pool: object | None) -> None:
        dev = owner.device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.dec_slots = torch.zeros(rows * ctx, dtype=torch.long, device=dev)
        self.dec_mask = torch.ones(rows, 1, 1, ctx, dtype=torch.bool, device=dev)
        # Capture writes K/V to slot 0 (block 0) for the dummy rows; harmless before any request
        # runs, which is when graphs are captured.
        args = (self.input_ids, self.positions, self.slots, self.dec_slots, self.dec_mask, owner.kv)
        self.graph = torch.cuda.CUDAGraph()
        self.out = _capture(self.graph, lambda: owner._eager(*args), dev, pool)

    def replay(self, dec: DecodeInputs, block_size: int) -> torch.Tensor:
        meta = step_metadata(dec, [], block_size, torch.device("cpu"), self.dec_mask.shape[-1])
        for dst, src in ((self.input_ids, torch.from_numpy(dec.token_ids)), (self.positions, meta.positions),
                         (self.slots, meta.slots), (self.dec_slots, meta.dec_slots), (self.dec_mask, meta.dec_mask)):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.out
