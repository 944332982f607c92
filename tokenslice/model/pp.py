"""Pipeline parallelism (FastServe §4.3, Fig. 10): the decoder layers split into contiguous
stages, each a group of tensor-parallel ranks; activations go stage to stage point-to-point.

Stage 0 holds the token embedding (OPT: also the positions and the input projection), the last
stage the final norm (OPT: output projection) and the LM head; a head tied to the embedding is
loaded into the last stage's head from the embedding's checkpoint tensor. Each stage's KV pool
holds only its own layers. Ranks are laid out stage-major: stage s holds global ranks
s*tp .. s*tp+tp-1, and TP rank r of stage s sends to TP rank r of stage s+1 (every TP rank holds
the whole hidden state after its all-reduce). `PPStage` is pure index arithmetic.

By default every stage gets as many layers (later stages take the extra); `layer_counts`
(`--pipeline-layers 5,3`) sets them, since the last stage also computes the LM head and the
slowest stage bounds a full pipe's throughput. `balanced_counts` picks counts from measured
per-layer and head times.
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenslice.model.arch import ArchConfig, ModelLoadError

_LAYER = re.compile(r"\.layers\.(\d+)\.")
FIRST_ONLY = ("embed_tokens", "embed_positions", "project_in")  # checkpoint module names on stage 0
LAST_ONLY = ("norm", "final_layer_norm", "project_out", "lm_head")  # ... and on the last stage


@dataclass(frozen=True)
class PPStage:
    """Stage `stage` of `size` over a model of `num_layers` decoder layers."""

    stage: int
    size: int
    num_layers: int  # the whole model's
    tie_word_embeddings: bool = False
    bounds: tuple[int, ...] | None = None  # the stages' first layers and the end; None: equal counts

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"stage {self.stage} outside a pipeline of {self.size}")
        if self.size > self.num_layers:
            raise ModelLoadError(f"pipeline_parallel_size {self.size} exceeds the model's {self.num_layers} layers")

    @classmethod
    def of(cls, arch: ArchConfig, stage: int, size: int, layer_counts: tuple[int, ...] | None = None) -> PPStage:
        """`layer_counts`: each stage's layers, first stage first; None: equal counts."""
        bounds = None
        if layer_counts is not None:
            if len(layer_counts) != size or min(layer_counts) < 1 or sum(layer_counts) != arch.num_layers:
                raise ModelLoadError(f"pipeline layers {','.join(map(str, layer_counts))}: need {size} counts of "
                                     f"at least 1 summing to the model's {arch.num_layers} layers")
            bounds = tuple(sum(layer_counts[:i]) for i in range(size + 1))
        return cls(stage, size, arch.num_layers, arch.tie_word_embeddings, bounds)

    @property
    def layers(self) -> tuple[int, int]:
        """[start, end) of the whole model's layers; an uneven equal split gives later stages the extra."""
        if self.bounds is not None:
            return self.bounds[self.stage], self.bounds[self.stage + 1]
        n, m = self.num_layers, self.size
        return self.stage * n // m, (self.stage + 1) * n // m

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The shapes of this stage's model: its layers only (hence its KV pool)."""
        start, end = self.layers
        return dataclasses.replace(arch, num_layers=end - start)

    def local_name(self, name: str) -> str | None:
        """The stage model's name for the checkpoint tensor `name`, None if another stage holds it."""
        m = _LAYER.search(name)
        if m is not None:
            start, end = self.layers
            i = int(m.group(1))
            if not start <= i < end:
                return None
            return f"{name[:m.start()]}.layers.{i - start}.{name[m.end():]}"
        module = name.split(".")[-2] if "." in name else name
        if module == "embed_tokens" and self.tie_word_embeddings and self.is_last and not self.is_first:
            return "lm_head.weight"  # the tied head reads the embedding's tensor
        if (module in FIRST_ONLY and not self.is_first) or (module in LAST_ONLY and not self.is_last):
            return None
        return name

    def global_name(self, local: str) -> str:
        """The inverse of local_name for a stage model's parameter."""
        m = _LAYER.search(local)
        if m is None:
            return local
        return f"{local[:m.start()]}.layers.{int(m.group(1)) + self.layers[0]}.{local[m.end():]}"


def balanced_counts(layer_s: float, head_s: float, num_layers: int, size: int) -> tuple[int, ...]:
    """Layers per stage for `size` contiguous stages of at least one layer, each layer taking
    `layer_s` and the last stage also `head_s`: the split whose slowest stage is fastest (ties:
    the earliest cuts)."""
    def weight(start: int, end: int) -> float:
        return (end - start) * layer_s + (head_s if end == num_layers else 0.0)

    # best[k][e]: (slowest stage, cuts) over splits of layers [0, e) into k stages.
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, (0,))}]
    for k in range(1, size + 1):
        row: dict[int, tuple[float, tuple[int, ...]]] = {}
        for end in range(k, num_layers - (size - k) + 1):
            row[end] = min((max(best[k - 1][start][0], weight(start, end)), best[k - 1][start][1] + (end,))
                           for start in best[k - 1] if start < end)
        best.append(row)
    cuts = best[size][num_layers][1]
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


class StagePipe:
    """A stage's point-to-point links: receive the batch's hidden states from the previous
    stage, send its own to the next. Sends are asynchronous, so a stage takes up its next batch
    while the next stage still computes this one; a send is completed before the next is issued.
    `wait_seconds` sums the time blocked on either side (pipeline bubbles, not work)."""

    def __init__(self, stage: PPStage, rank: int, tp_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.stage = stage
        self.prev = rank - tp_size if not stage.is_first else None
        self.next = rank + tp_size if not stage.is_last else None
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sending: tuple[dist.Work, torch.Tensor] | None = None  # the tensor stays alive until sent
        self.wait_seconds = 0.0

    def recv(self, num_tokens: int) -> torch.Tensor:
        assert self.prev is not None
        buf = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        t0 = time.perf_counter()
        dist.recv(buf, src=self.prev)
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def send(self, hidden: torch.Tensor) -> None:
        assert self.next is not None
        self.flush()
        hidden = hidden.contiguous()
        self._sending = (dist.isend(hidden, dst=self.next), hidden)

    def flush(self) -> None:
        """Wait until the last send was taken."""
        if self._sending is not None:
            t0 = time.perf_counter()
            self._sending[0].wait()
            self.wait_seconds += time.perf_counter() - t0
            self._sending = None
