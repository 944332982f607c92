"""Compiled decode: a decode-only step (forward + LM head) run as compiled code instead of
op-by-op eager PyTorch, whose per-operator dispatch dominates small models' steps.

- CPU: torch.compile (inductor) of one decoder layer reused for all layers (tiny models: then of
  the whole model), a graph for one row and one for any larger batch (model/inductor_decode.py;
  not for models whose linears are oneDNN-packed, whose multi-row steps run faster eager). Built
  before the first step, or on a thread while steps run eager (`serve`: it answers within
  seconds). The context length is dynamic: no shape met later compiles again, and no row or key
  is padded beyond whole blocks. (Static shapes per bucket compiled again at every new context
  bucket: seconds mid-stream, and 4x slower steps behind serve on average.)
- CUDA: CUDA graphs captured at start-up and replayed with the step's inputs copied into static
  buffers (vLLM's decode graphs), the batch padded to a power of two by repeating row 0 (whose
  K/V write then lands twice in the same slot with the same value). With the triton attention
  backend the kernels read each row's context in place up to its length, so one graph per
  batch bucket serves every context (block tables padded to the longest context). With sdpa
  the context is gathered, so there is a graph per batch and context bucket (a power of two
  blocks; the mask hides the padding). A step larger than every bucket runs eager. Captured
  before serving: a capture writes block 0, which a live request may own.

Neither the compiler nor a graph may copy the KV pool. On CPU the graph only reads it and
returns the new K/V, which one index_copy_ then writes for all layers. A CUDA graph keeps the
write and attention in one opaque operator (attention.decode_attention). Mixed steps (prefill
rows) always run eager.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from tokenslice.model.attention import AttentionMetadata, decode_slots, step_metadata
from tokenslice.model.inductor_decode import CompileStatus, InductorDecode, decoder_parts
from tokenslice.model.input_batch import DecodeInputs
from tokenslice.model.layers import InputMajorLinear
from tokenslice.model.llama import HiddenCapture
from tokenslice.model.quant import QuantizedLinear

log = logging.getLogger("tokenslice.model.compiled_decode")

# Models this small get whole-model graphs too, built after the per-layer ones and replacing
# them: there a layer call's own cost (guards, wrappers: ~70 us) is most of the step (stories260k,
# one row: 0.77 ms per layer-compiled step, 0.43 ms whole), while on SmolLM2-135M it is 11%
# (22.1 vs 19.9 ms), not worth a whole-model compilation of minutes (benchmarks/startup).
WHOLE_MODEL_MAX_PARAMS = 10_000_000


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to the first one covering `limit`."""
    out = [start]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


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
                 max_batch_size: int, max_model_len: int, backend: str = "sdpa", background: bool = False) -> None:
        self.model, self.kv, self.block_size, self.device = model, kv, block_size, device
        self.backend = backend
        self.graphs: dict[tuple[int, int], _Graph | _PagedGraph] = {}
        self.last_graph: torch.cuda.CUDAGraph | None = None  # the last step's
        self.multi_row = True  # a graph for steps of several rows as well
        self.batch_buckets = buckets(max_batch_size)
        # triton: one context "bucket", the longest (the kernels stop at each row's length).
        self.max_blocks = -(-max_model_len // block_size)
        self.ctx_buckets = ([self.max_blocks * block_size] if backend == "triton"
                            else buckets(max_model_len, block_size))
        self.inductor: InductorDecode | None = None
        if device.type == "cuda":
            t0 = time.perf_counter()
            log.info("capturing CUDA graphs: %d batch x %d context bucket(s)", len(self.batch_buckets),
                     len(self.ctx_buckets))
            self._capture_all()
            log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - t0)
            return
        # Multi-row steps stay eager where oneDNN's packed linears serve them (layers.py): with
        # those GEMMs and eager SDPA the 24M Llama served 16 streams 10-20% faster than
        # compiled (docs/benchmarks/decode-speed-and-llamacpp.md, "Compiled decode"); one row is faster compiled everywhere.
        # Likewise quantized linears with a bf16 copy for many rows (model/quant.py): compiled
        # code would always take the packed kernel, whose cost grows with every row.
        self.multi_row = max_batch_size > 1 and not any(
            (isinstance(m, InputMajorLinear) and m.packed is not None) or (isinstance(m, QuantizedLinear) and m.dense is not None)
            for m in model.modules())
        parts = decoder_parts(model)
        if parts is None:
            log.warning("no compiled decode for %s: its steps run eager", type(model).__name__)
            return
        whole = sum(p.numel() for p in model.parameters()) <= WHOLE_MODEL_MAX_PARAMS
        # Built before serving, a tiny model needs only its whole-model graphs.
        self.inductor = InductorDecode(model, parts, kv, block_size, self.multi_row,
                                       layer_graphs=background or not whole, whole_graphs=whole)
        if background:
            self.inductor.start()
        else:
            self.inductor.build()

    @property
    def status(self) -> CompileStatus:
        """The CPU build's progress (CUDA graphs are captured before serving: always ready)."""
        if self.inductor is not None:
            return self.inductor.status
        return CompileStatus("ready" if self.graphs else "off", len(self.graphs), len(self.graphs))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is built (or the build failed); False on timeout."""
        return self.inductor.wait(timeout) if self.inductor is not None else True

    def close(self) -> None:
        """Stop a background build (after the bucket it compiles)."""
        if self.inductor is not None:
            self.inductor.close()

    def _eager(self, *args: torch.Tensor) -> torch.Tensor:
        return _decode_logits(self.model, *args)

    def logits(self, dec: DecodeInputs, capture: HiddenCapture | None = None) -> torch.Tensor | None:
        """[D, vocab] logits of a decode-only step, or None where no compiled shape fits it.
        `capture` (rows after one layer): CPU layer graphs fill it; CUDA graphs cannot (None)."""
        if self.device.type != "cuda":
            if self.inductor is None or (len(dec.positions) > 1 and not self.multi_row):
                return None
            ids, positions, slots, dec_slots = self._inputs(dec)
            out = self.inductor.step(ids, positions, dec_slots, capture)
            if out is None:  # its bucket is still being built: eager
                return None
            logits, new_kv = out
            layers, _, blocks, bs, kvh, hd = self.kv.shape
            self.kv.view(layers, 2, blocks * bs, kvh, hd).index_copy_(2, slots, new_kv)
            return logits
        if capture is not None:
            return None
        d, bs = len(dec.positions), self.block_size
        b = next((b for b in self.batch_buckets if b >= d), None)
        c = next((c for c in self.ctx_buckets if c > int(dec.positions.max())), None)
        if b is None or c is None:
            return None
        width = dec.tables.shape[1] if self.backend == "triton" else c // bs  # triton: no context padding
        self.last_graph = self.graphs[(b, c)].graph  # the GPU check times it alone
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
