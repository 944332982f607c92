"""CostModel: seconds for one engine iteration and for one KV transfer (docs/DESIGN.md, "CostModel").

Two sources behind one interface:

- `RooflineCostModel` (roofline.py) — analytic: a `ModelSpec` on a `HardwareSpec` (specs.py),
  each layer two roofline operations, with tensor (`:tpN`) and pipeline (`:ppM`) parallelism.
- `ProfileCostModel` (profile.py) — fitted: a non-negative linear model over batch features measured on this
  machine (ALISE §3.1: iteration time is linear in the batch's token counts), built by
  `fit_profile` (fit.py) from (BatchShape, seconds) samples and stored as JSON.

This module holds what both share: the batch and loop shapes they price, the transfer link, the
CostModel interface, and `load_cost_model`.

Policies use the cost model (FastServe §4.1 skip-join needs the first-iteration time; ALISE's
SRPT needs remaining time) and the simulator uses it as its clock. No torch here.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Context length used for "short context" decode iterations (FastServe's q1 is one such step).
SHORT_CONTEXT = 1


@dataclass(frozen=True)
class BatchShape:
    """What one engine iteration computes, reduced to the features that drive its time.

    prefill_tokens: new prompt tokens processed this step (summed over prefill chunks).
    prefill_seqs: sequences with a prefill chunk this step.
    decode_seqs: sequences decoding one token this step.
    context_tokens: KV length each sequence attends to after this step, summed over all
        sequences (prefill and decode); drives the KV bytes attention reads.
    prefill_context: (query, key) pairs of the prefill queries under the causal mask,
        sum over chunks of q*past + q*(q+1)/2; drives prefill attention FLOPs, which grow
        quadratically with prompt length.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    prefill_context: int = 0

    @classmethod
    def from_lengths(cls, prefill: Sequence[tuple[int, int]] = (), decode: Sequence[int] = ()) -> BatchShape:
        """Exact shape from per-sequence lengths.

        prefill: (new tokens this step, tokens already cached) per prefill chunk.
        decode: context length (cached tokens + the one being decoded) per decoding sequence.
        """
        pt = sum(q for q, _ in prefill)
        pairs = sum(q * past + q * (q + 1) // 2 for q, past in prefill)
        ctx = sum(q + past for q, past in prefill) + sum(decode)
        return cls(prefill_tokens=pt, prefill_seqs=len(prefill), decode_seqs=len(decode),
                   context_tokens=ctx, prefill_context=pairs)

    @property
    def num_tokens(self) -> int:
        """Tokens that pass through the dense layers this step."""
        return self.prefill_tokens + self.decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    def is_empty(self) -> bool:
        return self.num_tokens == 0


@dataclass(frozen=True)
class LoopShape:
    """What the engine loop handles around one forward pass, besides the batch itself.

    live: unfinished requests after scheduling (running, waiting, preempted): the policy ranks
        and the scheduler walks all of them every step.
    sampled: tokens the step produced: each is appended, checked for a stop and sent on.
    arrivals: requests added since the previous step (in a real engine, between the two).
    """

    live: int = 0
    sampled: int = 0
    arrivals: int = 0


@dataclass(frozen=True)
class TransferSpec:
    """Device<->host copy cost: a fixed cost per copy operation plus bytes over the link."""

    bytes_per_s: float
    op_overhead_s: float

    def seconds(self, num_bytes: int, num_ops: int = 1) -> float:
        if num_bytes <= 0 and num_ops <= 0:
            return 0.0
        return max(num_ops, 0) * self.op_overhead_s + max(num_bytes, 0) / self.bytes_per_s


class CostModel(ABC):
    """Seconds per iteration and per transfer. Subclasses: RooflineCostModel, ProfileCostModel."""

    kind: str = ""
    pipeline_parallel: int = 1  # stages a batch passes through in turn (`stage_seconds`)

    @property
    @abstractmethod
    def name(self) -> str:
        """Human-readable identity, e.g. "opt-13b@a100-40gb" or a profile's model@device."""

    @property
    @abstractmethod
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes for one token of one sequence, all layers (what a swap moves)."""

    @abstractmethod
    def iteration_seconds(self, shape: BatchShape) -> float:
        """Wall time of one engine iteration computing `shape`; 0.0 for an empty batch."""

    @abstractmethod
    def transfer_seconds(self, num_bytes: int, num_ops: int = 1) -> float:
        """Wall time to copy `num_bytes` between device and host in `num_ops` copy operations."""

    @property
    def has_loop_cost(self) -> bool:
        """Whether `loop_seconds` can be non-zero (the simulator skips counting otherwise)."""
        return False

    def loop_seconds(self, loop: LoopShape) -> float:
        """Wall time of the engine loop's own work in one step (scheduling, bookkeeping, output,
        arrivals), which the simulator adds to the forward pass; 0.0 unless fitted on step traces."""
        return 0.0

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; `CostModel.from_dict` inverts it."""

    def check_fits(self) -> None:
        """ValueError when the model cannot run on the hardware this cost model describes (the
        simulator refuses it). A measured profile ran, so it fits."""

    def stage_seconds(self, shape: BatchShape) -> list[float]:
        """Seconds each pipeline stage computes `shape`, first stage first (one stage: the
        iteration). `iteration_seconds` = their sum + the point-to-point sends between them."""
        return [self.iteration_seconds(shape)]

    def p2p_seconds(self, num_tokens: int) -> float:
        """Sending `num_tokens` tokens' activations from one pipeline stage to the next."""
        return 0.0

    def stage_spread(self) -> list[float]:
        """Each stage's per-batch spread around `stage_seconds` (std / mean; 0: exact)."""
        return [0.0] * self.pipeline_parallel

    def first_iteration_seconds(self, prompt_len: int) -> float:
        """A lone prefill of `prompt_len` tokens: FastServe §4.1 skip-join picks the entry queue by it."""
        return self.iteration_seconds(BatchShape.from_lengths(prefill=[(max(prompt_len, 1), 0)]))

    def decode_seconds(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences, each attending `context` tokens."""
        if batch <= 0:
            return 0.0
        return self.iteration_seconds(BatchShape.from_lengths(decode=[max(context, 1)] * batch))

    def min_iteration_seconds(self) -> float:
        """Decode of one sequence at short context: the shortest useful quantum (FastServe's q1)."""
        return self.decode_seconds(1, SHORT_CONTEXT)

    def kv_transfer_seconds(self, num_tokens: int, num_ops: int = 1) -> float:
        """Convenience: move the KV of `num_tokens` tokens."""
        return self.transfer_seconds(num_tokens * self.kv_bytes_per_token, num_ops)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CostModel:
        # Imported here: both subclasses build on this module.
        from tokenslice.predict.profile import ProfileCostModel
        from tokenslice.predict.roofline import RooflineCostModel

        kind = data.get("kind")
        if kind == "roofline":
            return RooflineCostModel.from_dict(data)
        if kind == "profile":
            return ProfileCostModel.from_dict(data)
        raise ValueError(f"unknown cost model kind {kind!r}; expected 'roofline' or 'profile'")


def load_cost_model(spec: str) -> CostModel:
    """A cost model from "model@hardware[:tpN][:ppM][:nvlink|:pcie]" (e.g. "opt-13b@a100-40gb",
    "opt-66b@a100-40gb:tp4:pcie", "opt-175b@a100-40gb:tp8:pp2") or a JSON file path. The link
    defaults to the card's own; pipeline stages beyond one node talk over the node's network."""
    from tokenslice.predict.roofline import roofline_from_spec  # here: roofline.py builds on CostModel

    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"cost model profile {spec!r} does not exist")
        return CostModel.from_dict(json.loads(path.read_text()))
    return roofline_from_spec(spec)
