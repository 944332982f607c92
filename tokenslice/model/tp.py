"""Tensor parallelism, Megatron-style (Shoeybi et al. 2019, §3; FastServe §4.3 runs each stage so):
one rank's share of the model and the layers that join the shares.

Per decoder layer two all-reduces: the attention's q/k/v projections are split by heads
(column-parallel, every rank attends over its own heads and keeps only their KV), the output
projection by its input columns (row-parallel: partial sums, one all-reduce); the MLP's
gate/up (OPT: fc1) by intermediate rows and down (fc2) by columns, one all-reduce. The token
embedding and the LM head are split by vocabulary rows: each rank looks up or scores its rows,
an all-reduce joins the embedding, an all-gather the logits, so every rank holds the whole
logits and sampling is the one-rank code path. Norms, rotary tables, OPT's positions and
projections are replicated. With pipeline parallelism each stage is its own tensor-parallel
group (`group`); without it the group is torch.distributed's default one.

With more ranks than KV heads (GQA), each KV head is replicated on the ranks whose query heads
read it. Biases of row-parallel layers are added by rank 0 only (zeros elsewhere), so the
all-reduce adds them once. `TPShard` is pure index arithmetic, so the engine process can size
things without loading weights; the collectives use torch.distributed's default group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tokenslice.model.arch import ArchConfig, ModelLoadError

# Checkpoint module names by how they split (Llama family and OPT share the scheme).
QUERY_ROWS = ("q_proj",)
KV_ROWS = ("k_proj", "v_proj")
QUERY_COLS = ("o_proj", "out_proj")
MLP_ROWS = ("gate_proj", "up_proj", "fc1")
MLP_COLS = ("down_proj", "fc2")
VOCAB_ROWS = ("embed_tokens", "lm_head")


class Sliceable(Protocol):
    """A full checkpoint tensor that can be read in part: a safetensors slice or a tensor."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: which rows and columns of each full tensor it holds."""

    arch: ArchConfig  # the whole model
    rank: int
    size: int

    def __post_init__(self) -> None:
        a, n = self.arch, self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {n}")
        if a.num_heads % n:
            raise ModelLoadError(f"tensor_parallel_size {n} must divide the {a.num_heads} attention heads")
        if (a.num_kv_heads % n) if a.num_kv_heads >= n else (n % a.num_kv_heads):
            raise ModelLoadError(f"tensor_parallel_size {n} and the {a.num_kv_heads} KV heads: one must divide "
                                 "the other")
        if a.intermediate_size < n:
            raise ModelLoadError(f"tensor_parallel_size {n} exceeds the MLP width {a.intermediate_size}")

    @property
    def query_heads(self) -> tuple[int, int]:
        per = self.arch.num_heads // self.size
        return self.rank * per, per

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, count). Fewer KV heads than ranks: the one head this rank's queries read."""
        kvh, n = self.arch.num_kv_heads, self.size
        if kvh >= n:
            return self.rank * (kvh // n), kvh // n
        return self.rank // (n // kvh), 1

    @property
    def mlp_rows(self) -> tuple[int, int]:
        """[start, end) of the intermediate dimension; the remainder of an uneven split spreads
        over the ranks (row-parallel sums are exact for any split)."""
        width, n = self.arch.intermediate_size, self.size
        return self.rank * width // n, (self.rank + 1) * width // n

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, end) of the vocabulary; every rank holds `vocab_per_rank` rows, the last
        rank's beyond the vocabulary zero (their logits are cut off after the gather)."""
        start = self.rank * self.vocab_per_rank
        return min(start, self.arch.vocab_size), min(start + self.vocab_per_rank, self.arch.vocab_size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.size)

    @property
    def local_arch(self) -> ArchConfig:
        """The shapes of this rank's model: its heads, MLP rows and vocabulary rows."""
        start, end = self.mlp_rows
        return dataclasses.replace(self.arch, num_heads=self.query_heads[1], num_kv_heads=self.kv_heads[1],
                                   intermediate_size=end - start, vocab_size=self.vocab_per_rank)

    def read(self, name: str, full: Sliceable, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (full shape `shape`): only its
        slice is read, so a safetensors file is never loaded whole."""
        parts = name.split(".")
        module, kind = parts[-2], parts[-1]
        hd = self.arch.head_dim
        if module in QUERY_ROWS or module in KV_ROWS:
            first, count = self.query_heads if module in QUERY_ROWS else self.kv_heads
            return full[first * hd:(first + count) * hd]
        if module in MLP_ROWS:
            start, end = self.mlp_rows
            return full[start:end]
        if module in QUERY_COLS or module in MLP_COLS:
            if kind == "bias":  # added once, by rank 0, after the partial sums meet
                return full[:] if self.rank == 0 else torch.zeros(shape, dtype=full[:1].dtype)
            if module in QUERY_COLS:
                first, count = self.query_heads
                return full[:, first * hd:(first + count) * hd]
            start, end = self.mlp_rows
            return full[:, start:end]
        if module in VOCAB_ROWS:
            start, end = self.vocab_rows
            rows = full[start:end]
            pad = self.vocab_per_rank - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
        return full[:]


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns; the all-reduce sums the ranks' parts."""

    def __init__(self, linear: nn.Module, group: Any = None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token table; tokens outside them look up zeros, the all-reduce
    fills in each token's row from the rank that holds it."""

    def __init__(self, embedding: nn.Embedding, start: int, end: int, group: Any = None) -> None:
        super().__init__()
        self.embedding = embedding
        self.start, self.end = start, end
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        x = self.embedding((ids - self.start).masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary rows, all-gathered into the whole [tokens, vocab]."""

    def __init__(self, proj: nn.Module, vocab_size: int, size: int, group: Any = None) -> None:
        super().__init__()
        self.proj = proj
        self.vocab_size, self.size = vocab_size, size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.proj(hidden).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    @property
    def weight(self) -> nn.Parameter:  # read by the loader's tied-head check
        return self.proj.weight


def parallelize(model: nn.Module, shard: TPShard, group: Any = None) -> None:
    """Join a loaded shard into the whole model: wrap the row-parallel projections, the token
    embedding and the LM head in the layers above (their parameters stay where they are); their
    collectives run in `group` (None: the default group)."""
    start, end = shard.vocab_rows
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in QUERY_COLS or name in MLP_COLS:
                setattr(parent, name, RowParallelLinear(child, group))
            elif name == "embed_tokens":
                setattr(parent, name, VocabParallelEmbedding(child, start, end, group))
            elif name == "lm_head":
                setattr(parent, name, VocabParallelHead(child, shard.arch.vocab_size, shard.size, group))
