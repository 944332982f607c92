"""ModelRunner: owns the model and the KV tensors; turns a StepPlan into KV transfers and one
forward pass.

Two KV tiers (docs/DESIGN.md, KVManager): the device tensor `kv` and a host tensor of the same
layout, [layers, 2, blocks, block_size, kv_heads, head_dim] (pinned on CUDA so copies are DMA),
in the model dtype or, with offload_dtype="int8", as 8-bit codes plus per-channel metadata
(ALISE §3.2, model/kv_quant.py): quantized on the device before device->host, dequantized on
the device after host->device. A swap copies each contiguous run of (source, destination)
blocks (plan.copy_runs) across all layers in one strided copy: FastSwitch's point is that
per-copy overhead, not bandwidth, dominates fine-grained swapping, and block groups keep runs
long. On CPU that was measured against a batched gather (one index_select over all layers +
one index_copy_) and won at every fragmentation (docs/benchmarks/kv-swapping-and-memory.md, KV transfer bandwidth). On CUDA
a strided host<->device copy is not one DMA, so each run moves as 2 x layers contiguous
DMAs. Asynchronous transfers (FastServe §4.2, FastSwitch) run on model/transfer.TransferEngine
threads; on CUDA on side streams ordered after the compute that wrote the KV.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenslice.config import OFFLOAD_DTYPES, CacheConfig
from tokenslice.model.arch import ArchConfig
from tokenslice.model.attention import build_metadata, resolve_attention_backend, step_metadata
from tokenslice.model.compiled_decode import CompiledDecode
from tokenslice.model.inductor_decode import CompileStatus
from tokenslice.model.input_batch import DecodeBatch, decode_inputs
from tokenslice.model.kv_quant import QuantizedBlocks, dequantize_blocks, quantize_blocks, quantized_block_bytes
from tokenslice.model.llama import HiddenCapture
from tokenslice.model.loader import LoadedModel
from tokenslice.model.logprobs import float32_logits, prompt_logprobs, token_logprobs
from tokenslice.model.pp import StagePipe
from tokenslice.model.sampler import Sampler
from tokenslice.model.transfer import TransferEngine
from tokenslice.plan import PENDING_TOKEN, BlockTransfer, Direction, StepPlan, StepResult, copy_runs

log = logging.getLogger(__name__)


def zeroed_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool (padded attention slots read unwritten blocks and must not hold NaNs). On
    CPU from calloc (numpy): the kernel maps zero pages as they are first touched, so a pool of
    gigabytes costs nothing at start-up (torch.zeros writes every page: seconds)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def host_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype, offload_dtype: str = "auto") -> int:
    """Bytes one KV block takes on the host tier (and moves over the link)."""
    if offload_dtype == "int8":
        return quantized_block_bytes(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, dtype)
    return block_size * arch.kv_bytes_per_token // 4 * (torch.finfo(dtype).bits // 8)


def num_host_kv_blocks(cache: CacheConfig, loaded: LoadedModel, ranks: int = 1) -> int:
    """Host-tier blocks: an explicit `host_kv_blocks` wins, else --swap-space-gb (GiB, as vLLM)
    divided by the host block size in the offload dtype. With `ranks` tensor-parallel ranks
    (`loaded` is one's partition) the GiB hold all their partitions of each block."""
    explicit = getattr(cache, "host_kv_blocks", None)
    if explicit is not None:
        return int(explicit)
    if cache.swap_space_gb <= 0:
        return 0
    per_block = host_block_bytes(loaded.arch, cache.block_size, loaded.dtype, cache.offload_dtype) * ranks
    return int(cache.swap_space_gb * (1 << 30)) // per_block


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0,
                 num_host_blocks: int = 0, offload_dtype: str = "auto", transfer_threads: int = 2,
                 pipe: StagePipe | None = None, persistent_batch: bool = True, compile: bool = False,
                 cuda_graphs: bool = False, max_batch_size: int = 64, max_model_len: int = 2048,
                 attention_backend: str = "auto", compile_in_background: bool = False,
                 kv_source: str | None = None) -> None:
        if offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"offload_dtype must be one of {', '.join(OFFLOAD_DTYPES)}, got {offload_dtype!r}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        a = loaded.arch
        self.model = loaded.model
        # The loader kept the head's own weights where its logits are not float32 (logprobs need them).
        self.exact_head = getattr(self.model, "exact_head_weight", None) is not None
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attention_backend = resolve_attention_backend(attention_backend, self.device, a.head_dim)
        t0 = time.perf_counter()
        self.kv = zeroed_kv((a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim), self.dtype, self.device)
        self.num_host_blocks = num_host_blocks
        self.offload_dtype = offload_dtype
        self.host_block_bytes = host_block_bytes(a, block_size, self.dtype, offload_dtype)
        # Host tier: (kv,) in the model dtype, or (codes, span, zero) for int8. Never read before
        # written, so uninitialized; pinned on CUDA so copies are asynchronous DMA.
        shape = (a.num_layers, 2, num_host_blocks, block_size, a.num_kv_heads, a.head_dim)
        pin = self.device.type == "cuda"
        self.host: tuple[torch.Tensor, ...] = (
            QuantizedBlocks.empty(shape, self.dtype, "cpu", pin).tensors() if offload_dtype == "int8"
            else (torch.empty(shape, dtype=self.dtype, pin_memory=pin),))
        # The same tensors as rows of (layer, k/v): [2 x layers, blocks, ...]. A run of blocks is
        # then one slice [:, s:s+n], and each row of it is contiguous (one DMA on CUDA).
        self._kv_rows = self.kv.flatten(0, 1)
        self._host_rows = tuple(h.flatten(0, 1) for h in self.host)
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.0f MiB) on %s%s, %d host blocks (%.0f MiB), "
                 "in %.1f s",
                 num_blocks, block_size, num_blocks * block_size, self.kv.nbytes / 2**20, self.device,
                 f", sized by {kv_source}" if kv_source else "", num_host_blocks,
                 sum(h.nbytes for h in self.host) / 2**20, time.perf_counter() - t0)
        self.transfer_threads = transfer_threads
        self._engine: TransferEngine | None = None  # started by the first async transfer
        self._streams: dict[str, torch.cuda.Stream] = {}  # CUDA side streams, one per direction
        # Copy seconds of finished async jobs, written by a worker before it reports the job done.
        self._async_seconds: dict[str, float] = {}
        # How long an empty step waits for an async transfer before returning to the engine.
        self.idle_wait_s = 0.05
        self.sampler = Sampler(self.device, seed)
        # The last step's sampled tokens: a plan made before they were known (async scheduling)
        # computes them next, as PENDING_TOKEN (`fill_pending`).
        self._last_sampled: dict[str, int] = {}
        # A pipeline stage (model/pp.py): hidden states come from the previous stage and go on to
        # the next; only the last stage computes logits and samples.
        self.pipe = pipe
        # Decode rows kept between steps (model/input_batch.py); None rebuilds them from each plan.
        self.batch: DecodeBatch | None = DecodeBatch() if persistent_batch else None
        # Decode-only steps as compiled code: CUDA graphs on CUDA, inductor on CPU with `compile`.
        self.compiled: CompiledDecode | None = None
        # A stage's forward is not the whole model's: stages run eager. On CPU the triton backend
        # is Triton's interpreter (a correctness check), which nothing compiles.
        on_cuda = self.device.type == "cuda"
        if pipe is None and (cuda_graphs if on_cuda else compile and self.attention_backend == "sdpa"):
            self.compiled = CompiledDecode(self.model, self.kv, block_size, self.device, max_batch_size,
                                           max_model_len, self.attention_backend, background=compile_in_background)
        self.prep_seconds = 0.0  # summed time turning plans into tensors (overhead accounting)
        # The data plane's own record of what it copied (sync and async), for its tests and the
        # bandwidth benchmark: tensor copy calls issued (per run, per host tensor, per layer row on
        # CUDA) and bytes moved (int8-sized with offload_dtype="int8"). Swap accounting for
        # users is the scheduler's (SchedulerStats), where swap_ops counts block runs.
        self.copy_calls = 0
        self.copied_out_bytes = 0
        self.copied_in_bytes = 0

    def compile_status(self) -> CompileStatus:
        """Compiled decode's progress: off, pending (being built; steps run eager), ready, failed."""
        return self.compiled.status if self.compiled is not None else CompileStatus("off", 0, 0)

    @property
    def block_bytes(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.sampler.forget(plan.finished)
        self.fill_pending(plan)
        transfer_seconds = 0.0
        if plan.swap_out or plan.swap_in:  # critical path: before compute, out before in
            t1 = time.perf_counter()
            self.swap(plan.swap_out, "out")
            self.swap(plan.swap_in, "in")
            if self.device.type == "cuda":  # the copies are queued on the compute stream
                torch.cuda.current_stream(self.device).synchronize()
            transfer_seconds = time.perf_counter() - t1
        if plan.async_transfers:
            self._start_async(plan.async_transfers)
        result = StepResult(transfer_seconds=transfer_seconds)
        waited = self.pipe.wait_seconds if self.pipe is not None else 0.0
        if not plan.is_empty:
            self._compute(plan, result)
        elif self.batch is not None:  # nobody decodes: every row is stale by the next compute
            self.batch.update([])
        if self.pipe is not None:
            result.wait_seconds = self.pipe.wait_seconds - waited
        done: list[str] = []
        if self._engine is not None:
            done = self._engine.poll()
            if plan.is_empty and not done and self._engine.pending():
                done = self._engine.wait_any(self.idle_wait_s)  # nothing to compute: do not spin
        result.transfer_durations = {rid: self._async_seconds.pop(rid) for rid in done if rid in self._async_seconds}
        result.transfers_done = done
        result.step_seconds = time.perf_counter() - t0
        self._last_sampled = dict(result.sampled)  # a rank that does not answer empties result.sampled
        return result

    def fill_pending(self, plan: StepPlan) -> None:
        """Put the tokens the last step sampled in place of this plan's PENDING_TOKEN (a plan
        made while that step ran); a pending token is always its slice's only one."""
        for s in plan.decode:
            if s.token_ids[0] == PENDING_TOKEN:
                tok = self._last_sampled.get(s.request_id)
                if tok is None:
                    raise RuntimeError(f"request {s.request_id}: the step before this one sampled no token for it")
                s.token_ids = [tok]
                if s.history_token_ids:  # penalties count it
                    s.history_token_ids.append(tok)

    def _compute(self, plan: StepPlan, result: StepResult) -> None:
        """One forward pass; fills result.sampled and the logprobs of the slices that ask."""
        t0 = time.perf_counter()
        dec = self.batch.update(plan.decode, bool(plan.swap_in)) if self.batch is not None else decode_inputs(plan.decode)
        hidden = logits = None
        # One token per slice, each sampling and no prompt logprobs (a 1-token prompt chunk also
        # counts as decode): logits of every row, nothing to select. Logprobs from a head whose
        # logits are not float32 need the hidden states, which compiled steps do not return.
        every_row = not plan.prefill and all(
            s.sample and not s.prompt_logprob_targets and not (self.exact_head and s.params.logprobs is not None)
            for s in plan.decode)
        capture = self._hidden_capture(plan)
        if self.compiled is not None and every_row:  # compiled code returns logits (and captures) only
            self.prep_seconds += time.perf_counter() - t0
            logits = self.compiled.logits(dec, capture)
            if logits is not None and capture is not None:
                self._take_hidden(plan, capture, result)
        if logits is None:
            ids = torch.from_numpy(dec.token_ids)
            if plan.prefill:
                ids = torch.cat([ids, torch.tensor([t for s in plan.prefill for t in s.token_ids], dtype=torch.long)])
            input_ids = ids.to(self.device, non_blocking=True)
            meta = step_metadata(dec, plan.prefill, self.block_size, self.device, backend=self.attention_backend)
            self.prep_seconds += time.perf_counter() - t0
            pipe = self.pipe
            before = pipe.recv(plan.num_tokens) if pipe is not None and not pipe.stage.is_first else None
            if capture is None:
                hidden = self.model(input_ids, meta, self.kv, before)
            else:
                hidden = self.model(input_ids, meta, self.kv, before, capture=capture)
                self._take_hidden(plan, capture, result)
            if pipe is not None and not pipe.stage.is_last:
                pipe.send(hidden)
                return
        slices = plan.decode + plan.prefill
        if not every_row:
            # Logits only for the last token of each slice that samples.
            last, sampling = [], []
            end = 0
            for s in slices:
                if s.prompt_logprob_targets:
                    rows = range(end + s.prompt_logprob_offset, end + s.prompt_logprob_offset + len(s.prompt_logprob_targets))
                    result.prompt_logprobs[s.request_id] = prompt_logprobs(
                        hidden, list(rows), s.prompt_logprob_targets, s.params.prompt_logprobs or 0,
                        self._float32_logits)
                end += s.num_tokens
                if s.sample:
                    last.append(end - 1)
                    sampling.append(s)
            if not sampling:
                return
            assert hidden is not None  # only every_row steps run compiled
            hidden = hidden[torch.tensor(last, device=self.device)]
        else:
            sampling = slices
        logits = (self.model.compute_logits(hidden) if logits is None else logits).float()
        asks = [i for i, s in enumerate(sampling) if s.params.logprobs is not None]
        # Raw logits, copied before the sampler processes them in place (float32 ones, from the
        # hidden states, where the head rounds its own).
        raw = None
        if asks:
            at = torch.tensor(asks, device=self.device)
            raw = self._float32_logits(hidden[at]) if self.exact_head and hidden is not None else logits[at]
        tokens = self.sampler.sample(logits, sampling)
        result.sampled.update(zip([s.request_id for s in sampling], tokens, strict=True))
        if raw is not None:
            chosen = torch.tensor([tokens[i] for i in asks], device=self.device)
            lps = token_logprobs(raw, chosen, [sampling[i].params.logprobs or 0 for i in asks])
            for i, lp in zip(asks, lps, strict=True):
                result.logprobs[sampling[i].request_id] = lp

    def _hidden_capture(self, plan: StepPlan) -> HiddenCapture | None:
        """What this step's forward copies out for length prediction: the last token of each
        slice with capture_hidden, after plan.hidden_layer. None when nothing asks, or the model
        cannot (another architecture, a pipeline stage)."""
        if plan.hidden_layer is None or self.pipe is not None or not getattr(self.model, "supports_hidden_capture", False):
            return None
        rows, end = [], 0
        for s in plan.decode + plan.prefill:  # the forward's row order
            end += s.num_tokens
            if s.capture_hidden:
                rows.append(end - 1)
        if not rows:
            return None
        return HiddenCapture(plan.hidden_layer, torch.tensor(rows, device=self.device))

    @staticmethod
    def _take_hidden(plan: StepPlan, capture: HiddenCapture, result: StepResult) -> None:
        assert capture.out is not None, f"hidden layer {capture.layer} is not a layer of this model"
        ids = [s.request_id for s in plan.decode + plan.prefill if s.capture_hidden]
        result.hidden.update(zip(ids, capture.out.float().cpu().tolist(), strict=True))

    # ---- KV swapping --------------------------------------------------------------------------
    def swap(self, pairs: Sequence[tuple[int, int]], direction: Direction) -> None:
        """Copy blocks between tiers now, on the current stream: "out" takes (device block, host
        block) pairs, "in" (host block, device block) pairs. Counts ops and bytes."""
        if not pairs:
            return
        runs = self._checked_runs(pairs, direction)
        self._account(len(pairs), len(runs), direction)
        self._copy_runs(runs, direction)

    def _copy_runs(self, runs: list[tuple[int, int, int]], direction: Direction) -> None:
        int8 = self.offload_dtype == "int8"
        kv, host = self._kv_rows, self._host_rows
        for s, d, n in runs:
            if direction == "out":
                src, dst = kv[:, s:s + n], tuple(h[:, d:d + n] for h in host)
                if not int8:
                    self._cross_copy(dst[0], src)
                elif self.device.type == "cpu":  # codes straight into the host slices
                    quantize_blocks(src, QuantizedBlocks(*dst))
                else:  # quantize on the device, move the (smaller) codes
                    for h, t in zip(dst, quantize_blocks(src).tensors(), strict=True):
                        self._cross_copy(h, t)
            else:
                src, dst = tuple(h[:, s:s + n] for h in host), kv[:, d:d + n]
                if not int8:
                    self._cross_copy(dst, src[0])
                else:  # move the codes, dequantize on the device
                    dequantize_blocks(QuantizedBlocks(*(self._on_device(t) for t in src)), dst)

    def _cross_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src for [2 x layers, n, ...] row slices of the two tiers. Same memory (CPU):
        one strided copy. Host <-> CUDA: torch would stage a strided copy through pageable
        temporaries, so copy row by row, each contiguous on both sides: one asynchronous DMA
        per row from/to pinned memory."""
        if dst.device == src.device:
            dst.copy_(src)
            return
        for row in range(dst.shape[0]):
            dst[row].copy_(src[row], non_blocking=True)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        self._cross_copy(out, t)
        return out

    def _checked_runs(self, pairs: Sequence[tuple[int, int]], direction: Direction) -> list[tuple[int, int, int]]:
        runs = copy_runs(pairs)
        src_n, dst_n = ((self.num_blocks, self.num_host_blocks) if direction == "out"
                        else (self.num_host_blocks, self.num_blocks))
        for s, d, n in runs:  # slicing would silently truncate an out-of-range run
            if s < 0 or d < 0 or s + n > src_n or d + n > dst_n:
                raise ValueError(f"swap {direction}: blocks {s}..{s + n - 1} -> {d}..{d + n - 1} out of range "
                                 f"({src_n} source, {dst_n} destination blocks)")
        return runs

    def _account(self, num_blocks: int, num_runs: int, direction: Direction) -> None:
        """Counters, from the planning thread only (workers never touch them)."""
        per_run = len(self.host) * (1 if self.device.type == "cpu" else self._kv_rows.shape[0])
        self.copy_calls += num_runs * per_run
        if direction == "out":
            self.copied_out_bytes += num_blocks * self.host_block_bytes
        else:
            self.copied_in_bytes += num_blocks * self.host_block_bytes

    # ---- asynchronous transfers ---------------------------------------------------------------
    def _start_async(self, transfers: list[BlockTransfer]) -> None:
        if self._engine is None:
            self._engine = TransferEngine(self.transfer_threads)
        ready = None
        if self.device.type == "cuda":
            # Everything queued on the compute stream so far (the last step's KV writes, this
            # step's sync swaps) happens before the side streams touch those blocks.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for t in transfers:
            if not t.pairs:
                self._engine.submit(t.request_id, lambda: None)
                continue
            runs = self._checked_runs(t.pairs, t.direction)
            self._account(len(t.pairs), len(runs), t.direction)
            stream = self._stream(t.direction) if ready is not None else None
            self._engine.submit(t.request_id, self._async_job(t.request_id, runs, t.direction, stream, ready))

    def _async_job(self, request_id: str, runs: list[tuple[int, int, int]], direction: Direction,
                   stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None) -> Callable[[], None]:
        """The copy a worker runs. The caller guarantees (KVManager transfer windows) that no
        compute touches these blocks and the request is not scheduled until it is reported.
        Its copy seconds (on CUDA: between events on the side stream, so waiting for the
        compute stream is excluded) are kept for StepResult.transfer_durations."""
        def job() -> None:
            with torch.inference_mode():
                if stream is None or ready is None:
                    t0 = time.perf_counter()
                    self._copy_runs(runs, direction)
                    self._async_seconds[request_id] = time.perf_counter() - t0
                    return
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    self._copy_runs(runs, direction)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(stream)
                done.synchronize()  # report the request only once the DMA landed
                self._async_seconds[request_id] = start.elapsed_time(done) / 1000.0
        return job

    def _stream(self, direction: Direction) -> torch.cuda.Stream:
        # One side stream per direction: the host link is full duplex (two copy engines).
        # Created on the planning thread only.
        if direction not in self._streams:
            self._streams[direction] = torch.cuda.Stream(self.device)
        return self._streams[direction]

    @property
    def transfers_pending(self) -> int:
        return self._engine.pending() if self._engine is not None else 0

    def close(self) -> None:
        """Let queued transfers finish and stop the transfer threads and a background compilation.
        Idempotent."""
        if self.compiled is not None:
            self.compiled.close()
        if self._engine is not None:
            self._engine.close()

    @torch.inference_mode()
    def prompt_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every position of a prefill-only plan (for checks against a reference)."""
        slices = plan.decode + plan.prefill
        ids = [t for s in slices for t in s.token_ids]
        meta = build_metadata(plan.decode, plan.prefill, self.block_size, self.device, self.attention_backend)
        hidden = self.model(torch.tensor(ids, device=self.device), meta, self.kv)
        return self._float32_logits(hidden)

    def _float32_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return float32_logits(self.model, hidden)

    @torch.inference_mode()
    def prompt_hidden(self, plan: StepPlan, layer: int, rows: list[int]) -> torch.Tensor:
        """Hidden states after `layer` at `rows` of a prefill-only plan: an answer's states in one
        pass (the length predictor's training features, as serving captures them token by token)."""
        slices = plan.decode + plan.prefill
        ids = [t for s in slices for t in s.token_ids]
        meta = build_metadata(plan.decode, plan.prefill, self.block_size, self.device, self.attention_backend)
        capture = HiddenCapture(layer, torch.tensor(rows, device=self.device))
        self.model(torch.tensor(ids, device=self.device), meta, self.kv, capture=capture)
        assert capture.out is not None, f"hidden layer {layer} is not a layer of this model"
        return capture.out.float()
