"""Decode steps compiled by torch.compile (inductor) on CPU, one decoder layer at a time, built
before serving or on a thread while steps run eager.

Regional compilation (PyTorch's recipe "Reducing torch.compile cold start compilation time with
regional compilation"): a model's layers are one piece of code over weights of the same shapes,
so one compiled layer serves every layer (the weights are graph inputs), and compiling costs
about one layer's worth instead of the whole stack's. The embedding, the final norm and the head
stay eager. Each layer's graph only reads the KV pool: attention (attention.traced_decode_attention)
gathers the row's context through its slots with its new K/V in place, and returns the new K/V
for the caller to write after the step (one index_copy_ for all layers). A layer call costs
~70 us of its own once guards are skipped (see `step`): a tenth of SmolLM2-135M's step, but
most of a tiny model's, which therefore also gets whole-model graphs (compiled_decode.py).

Buckets: a graph for one row and, where multi-row steps are compiled (compiled_decode.py), one
for any larger batch (the row count a dynamic dimension; a dimension of size 1 would be
specialized, hence its own graph). The context length is dynamic in both, so no shape met later
compiles again. Each bucket is a function of its own (its own code object, hence its own dynamo
cache): serving from a built bucket never reads a cache that the next bucket's compilation writes.

In the background (`serve`): a thread builds the buckets, one row first, while steps run eager;
a bucket serves from the first step after it is built. Its Python competes with the serving
thread for the interpreter lock: eager steps run slower meanwhile (benchmarks/startup).
Inductor's cache lives in a user cache directory (inductor_cache_dir), so a second start only
loads what the first compiled.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenslice.model.attention import AttentionMetadata
from tokenslice.model.llama import HiddenCapture, LlamaForCausalLM
from tokenslice.model.opt import OPT_POSITION_OFFSET, OPTForCausalLM

log = logging.getLogger("tokenslice.model.compiled_decode")

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled kernels: $TORCHINDUCTOR_CACHE_DIR where the user chose one,
    else $XDG_CACHE_HOME/tokenslice/inductor (~/.cache/...), kept across reboots unlike
    inductor's own default in /tmp (which importing torch._dynamo writes into the environment,
    hence the comparison)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenslice" / "inductor"


@dataclass
class DecoderParts:
    """A model cut around its layers: `embed` gives the hidden states and the per-step tensors
    every layer takes before its KV (Llama: the rotary cos/sin), `final` the logits."""
    layers: list[nn.Module]
    embed: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
    final: Callable[[torch.Tensor], torch.Tensor]


def decoder_parts(model: nn.Module) -> DecoderParts | None:
    """The model's forward (llama.py, opt.py) as embed, layers, final; None for another model."""
    if isinstance(model, LlamaForCausalLM):
        inner = model.model

        def llama_embed(ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            x = inner.embed_tokens(ids)
            return x, model.rotary(positions, x.dtype)
        return DecoderParts(list(inner.layers), llama_embed, lambda x: model.compute_logits(inner.norm(x)))
    if isinstance(model, OPTForCausalLM):
        dec = model.model.decoder

        def opt_embed(ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            x = dec.embed_tokens(ids)
            x = dec.project_in(x) if dec.project_in is not None else x
            return x + dec.embed_positions(positions + OPT_POSITION_OFFSET), ()

        def opt_final(x: torch.Tensor) -> torch.Tensor:
            x = dec.final_layer_norm(x) if dec.final_layer_norm is not None else x
            return model.compute_logits(dec.project_out(x) if dec.project_out is not None else x)
        return DecoderParts(list(dec.layers), opt_embed, opt_final)
    return None


def _layer_step(layer: nn.Module, x: torch.Tensor, aux: tuple[torch.Tensor, ...], kv_layer: torch.Tensor,
                positions: torch.Tensor, dec_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a decode-only step: its output and its new K/V, [2, D, KVH, hd]."""
    meta = AttentionMetadata(positions=positions, slots=positions, num_decode=x.shape[0],  # slots: unused
                             dec_slots=dec_slots, dec_len=dec_slots.shape[1], new_kv=[])
    return layer(x, *aux, kv_layer, meta), meta.new_kv[0]


def _one_row_layer(layer: nn.Module, x: torch.Tensor, aux: tuple[torch.Tensor, ...], kv_layer: torch.Tensor,
                   positions: torch.Tensor, dec_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_step(layer, x, aux, kv_layer, positions, dec_slots)


def _rows_layer(layer: nn.Module, x: torch.Tensor, aux: tuple[torch.Tensor, ...], kv_layer: torch.Tensor,
                positions: torch.Tensor, dec_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_step(layer, x, aux, kv_layer, positions, dec_slots)


def _model_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, dec_slots: torch.Tensor,
                kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole decode-only step: logits and the new K/V of all layers, [layers, 2, D, KVH, hd]."""
    meta = AttentionMetadata(positions=positions, slots=positions, num_decode=ids.shape[0],  # slots: unused
                             dec_slots=dec_slots, dec_len=dec_slots.shape[1], new_kv=[])
    return model.compute_logits(model(ids, meta, kv)), torch.stack(meta.new_kv)


def _one_row_model(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, dec_slots: torch.Tensor,
                   kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _model_step(model, ids, positions, dec_slots, kv)


def _rows_model(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, dec_slots: torch.Tensor,
                kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _model_step(model, ids, positions, dec_slots, kv)


@dataclass
class Bucket:
    name: str
    rows: int  # the rows of the step it is compiled with (1, or 2 for "any larger batch")
    region: StepFn  # the function compiled: one layer, or the whole model (whole=True)
    whole: bool = False
    run: StepFn | None = None  # set once built: the region running only what was compiled
    seconds: float | None = None
    threads: int = 0  # torch threads it was built with: its graphs are guarded on that count


@dataclass
class CompileStatus:
    """What /v1/state reports as compiled_decode: off, pending (being built: steps run eager),
    ready, failed; buckets built of all; seconds from the start of the build to the last bucket;
    steps run compiled so far."""
    state: str
    buckets_ready: int
    buckets: int
    seconds: float | None = None
    steps: int = 0
    error: str | None = None


class InductorDecode:
    def __init__(self, model: nn.Module, parts: DecoderParts, kv: torch.Tensor, block_size: int, multi_row: bool,
                 layer_graphs: bool = True, whole_graphs: bool = False) -> None:
        """Graphs of one layer, and/or of the whole model (built after the layer ones, which
        they replace once built; model/compiled_decode.py decides: for tiny models, whose steps
        the per-layer calls slow most)."""
        self.model, self.parts, self.kv, self.block_size = model, parts, kv, block_size
        rows = [1, 2] if multi_row else [1]
        self.buckets: list[Bucket] = []
        if layer_graphs:
            self.buckets += [Bucket(f"{'1 row' if d == 1 else '2+ rows'}, one layer", d, f)
                             for d, f in zip(rows, (_one_row_layer, _rows_layer))]
        if whole_graphs:
            self.buckets += [Bucket(f"{'1 row' if d == 1 else '2+ rows'}, whole model", d, f, whole=True)
                             for d, f in zip(rows, (_one_row_model, _rows_model))]
        self.started_at: float | None = None
        self.seconds: float | None = None
        self.error: str | None = None
        self.steps = 0  # run compiled
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._stopping = False
        self._threads_warned = False

    # ---- building ------------------------------------------------------------------------------
    def build(self) -> None:
        """Compile every bucket now (raises what compilation raises)."""
        self._prepare()
        for b in self.buckets:
            self._compile(b)
        self._finish()

    def start(self) -> None:
        """Compile every bucket on a thread; steps run eager until their bucket is built."""
        self._prepare()
        threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._build_in_background, args=(threads,),
                                        name="tokenslice-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ended (built, failed or stopped); False on timeout."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop a background build after the bucket being compiled (nothing will run it)."""
        self._stopping = True

    def _prepare(self) -> None:
        # Inductor reads its cache directory from the environment when it compiles.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
        import torch._inductor.config as inductor_config

        # One C++ file per graph: a pool of compile workers (processes importing torch) would
        # only add their start-up to the cores the server uses.
        inductor_config.compile_threads = 1
        self.started_at = time.perf_counter()
        log.info("compiling decode steps: %d bucket(s) (%s; a layer's graph serves all %d); inductor cache %s",
                 len(self.buckets), "; ".join(b.name for b in self.buckets), len(self.parts.layers),
                 os.environ["TORCHINDUCTOR_CACHE_DIR"])

    def _build_in_background(self, threads: int) -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: the warm-up steps' own
        try:
            for b in self.buckets:
                if self._stopping:
                    self._done.set()
                    return
                self._compile(b)
        except Exception as e:  # the server keeps serving eager
            self.error = f"{type(e).__name__}: {e}"
            log.warning("compiling decode steps failed; they stay eager (%s)", self.error, exc_info=True)
            self._done.set()
            return
        self._finish()

    def _finish(self) -> None:
        assert self.started_at is not None
        self.seconds = time.perf_counter() - self.started_at
        log.info("decode steps compiled: %d bucket(s) in %.1f s", len(self.buckets), self.seconds)
        self._done.set()

    @torch.inference_mode()
    def _compile(self, bucket: Bucket) -> None:
        """Compile `bucket` by running one step of it on placeholder inputs (every layer: a layer
        whose guards differ, e.g. another weight format, compiles its own graph), then let steps
        use it. The step writes nothing; the pool is only read."""
        t0 = time.perf_counter()
        d, keys = bucket.rows, -(-2 // self.block_size) * self.block_size  # >= 2 keys: see the module doc
        ids, positions = torch.zeros(d, dtype=torch.long), torch.ones(d, dtype=torch.long)
        dec_slots = torch.zeros(d, keys, dtype=torch.long)
        x, aux = self.parts.embed(ids, positions)
        for t in (ids, x, *aux, positions, dec_slots) if d > 1 else ():  # the rows
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(dec_slots, 1)  # the keys
        # dynamic=False: only the dimensions marked above are dynamic.
        compiled = torch.compile(bucket.region, dynamic=False, fullgraph=True)
        if bucket.whole:
            compiled(self.model, ids, positions, dec_slots, self.kv)
        for i, layer in enumerate(self.parts.layers if not bucket.whole else ()):
            x, _ = compiled(layer, x, aux, self.kv[i], positions, dec_slots)
        # From here on only these graphs run: a step they do not take runs eager instead of
        # compiling mid-stream, and no step pays for marking dimensions again.
        bucket.run = torch._dynamo.run(bucket.region)
        bucket.threads = torch.get_num_threads()
        bucket.seconds = time.perf_counter() - t0
        ready = sum(b.run is not None for b in self.buckets)
        log.info("decode bucket %s compiled in %.1f s (%d/%d); its steps run compiled from now on",
                 bucket.name, bucket.seconds, ready, len(self.buckets))

    # ---- serving -------------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, positions: torch.Tensor, dec_slots: torch.Tensor,
             capture: HiddenCapture | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits and the new K/V of all layers, [layers, 2, D, KVH, hd], of a decode-only step;
        None while its bucket is not built (or where none takes it). `capture`: rows after one
        layer are copied out between the layer graphs (a whole-model graph cannot: not taken)."""
        rows = min(len(ids), 2)
        built = [b for b in self.buckets if b.rows == rows and b.run is not None and not (capture and b.whole)]
        threads = torch.get_num_threads()
        if built and built[-1].threads != threads:
            # Run with another thread count, a graph fails its guards (and with guards skipped,
            # raises): eager, as where no graph was built. The engine core sets its count first.
            if not self._threads_warned:
                self._threads_warned = True
                log.warning("decode graphs were built with %d torch threads and steps run with %d: "
                            "these steps run eager", built[-1].threads, threads)
            return None
        if not built:
            return None
        bucket = built[-1]  # the whole model's once built
        run = bucket.run
        assert run is not None
        # Once the build is over, no guard needs checking: every layer met the graphs at build
        # time (a layer that differs got its own), and the caller sends each bucket only the
        # shapes it was built for. Guards are most of a layer call's overhead (230 us of ~400 on
        # SmolLM2's); the setting is process-wide, so never while the build thread compiles.
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self._done.is_set()):
            if bucket.whole:
                self.steps += 1
                return run(self.model, ids, positions, dec_slots, self.kv)
            x, aux = self.parts.embed(ids, positions)
            new_kv = []
            for i, layer in enumerate(self.parts.layers):
                x, layer_kv = run(layer, x, aux, self.kv[i], positions, dec_slots)
                new_kv.append(layer_kv)
                if capture is not None and i == capture.layer:
                    capture.out = x.index_select(0, capture.rows)
        self.steps += 1
        return self.parts.final(x), torch.stack(new_kv)

    @property
    def status(self) -> CompileStatus:
        ready = sum(b.run is not None for b in self.buckets)
        state = "failed" if self.error else "ready" if ready == len(self.buckets) else "pending"
        return CompileStatus(state, ready, len(self.buckets), self.seconds, self.steps, self.error)
