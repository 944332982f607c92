"""CostModel: seconds for one engine iteration and for one KV transfer (docs/DESIGN.md, "CostModel").

Two sources behind one interface:

- `RooflineCostModel` — analytic: a `ModelSpec` on a `HardwareSpec`. Each layer is two roofline
  operations (dense matmuls against the weights, attention against the KV cache); an operation
  takes max(FLOPs / compute rate, bytes / memory bandwidth), plus fixed kernel-launch and
  per-iteration overheads. Efficiency factors are calibrated so that opt-13b on an A100-40GB
  decodes one sequence in ~23 ms and prefills a lone 512-token prompt in ~80 ms, the reference
  values the project's issues quote. With tensor parallelism (`:tpN`) every GPU computes and
  reads 1/N of the weights and KV, and the iteration pays Megatron-style ring collectives over
  the GPU link (`tp_comm_seconds`; `:nvlink` or `:pcie`, default the card's own). With pipeline
  parallelism (`:ppM`) the layers split into M stages of TP groups (`stage_seconds`), and a
  batch's activations cross each stage boundary point to point (`p2p_seconds`): over the GPU
  link when all stages fit one node, over the node's network otherwise.
- `ProfileCostModel` — fitted: a non-negative linear model over batch features measured on this
  machine (ALISE §3.1: iteration time is linear in the batch's token counts), built by
  `fit_profile` from (BatchShape, seconds) samples and stored as JSON.

Policies use the cost model (FastServe §4.1 skip-join needs the first-iteration time; ALISE's
SRPT needs remaining time) and the simulator uses it as its clock. No torch here.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

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
class HardwareSpec:
    """One accelerator, from its public datasheet, plus calibrated efficiency and overheads."""

    name: str
    matmul_flops: float  # dense fp16/bf16 tensor-core FLOP/s (no sparsity)
    memory_bandwidth: float  # device memory B/s
    host_link_bandwidth: float  # effective device<->host B/s for KV swap (PCIe)
    memory_bytes: float  # device memory capacity
    interconnect_bandwidth: float  # GPU<->GPU B/s per direction over the card's own link (NVLink on SXM parts)
    op_overhead_s: float = 4e-6  # per kernel launch: a small decode step is launch-bound
    transfer_op_overhead_s: float = 10e-6  # per cudaMemcpyAsync: why FastSwitch groups blocks
    iteration_overhead_s: float = 0.8e-3  # scheduling, sampling, host sync per iteration
    allreduce_latency_s: float = 15e-6  # fixed cost of one all-reduce over the card's own link
    nvlink: bool = True  # False: the card has no NVLink, interconnect_bandwidth is its PCIe
    pcie_bandwidth: float = 32e9  # GPU<->GPU B/s per direction over PCIe (gen3 16, gen4 32, gen5 64 GB/s)
    pcie_allreduce_latency_s: float = 30e-6  # one all-reduce through the PCIe switch / host bridge
    compute_efficiency: float = 0.54  # achieved / peak FLOP/s (calibrated, see module doc)
    memory_efficiency: float = 0.80  # achieved / peak memory bandwidth (calibrated)
    gpus_per_node: int = 8  # one server's GPUs: pipeline stages beyond it talk over the network
    # Between nodes (pipeline stage boundaries): the server's network in B/s per direction, and
    # the fixed cost of one point-to-point send. Default: AWS p4d.24xlarge (8 x A100-40GB, FastServe
    # §5's two-node setting), "400 Gbps instance networking" over EFA (aws.amazon.com/ec2/
    # instance-types/p4/) = 50 GB/s. The latency is an estimate of one small NCCL send over EFA
    # (tens of microseconds; no datasheet states it).
    node_link_bandwidth: float = 50e9
    node_link_latency_s: float = 20e-6


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer architecture, from the model's public config."""

    name: str
    num_params: float  # as published; the roofline uses the per-layer count derived below
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = False  # Llama-style SwiGLU has three MLP matrices, OPT two
    tied_embeddings: bool = True
    bytes_per_param: int = 2
    kv_bytes_per_value: int = 2  # KV cache dtype width

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (biases and norms are negligible and left out)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def derived_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value


# Datasheet numbers (dense fp16/bf16 tensor-core peak, HBM bandwidth). Host links are effective
# rates for pinned copies: PCIe gen3 x16 ~12 GB/s, gen4 ~25 GB/s, gen5 ~50 GB/s. GPU<->GPU links are
# per-direction datasheet peaks: NVLink 2/3/4 give 150/300/450 GB/s (V100/A100/H100 SXM, half the
# bidirectional figure), PCIe x16 gen3/4/5 16/32/64 GB/s. The A10 has no NVLink.
HARDWARE_SPECS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", matmul_flops=312e12, memory_bandwidth=1.555e12,
                              host_link_bandwidth=25e9, memory_bytes=40e9, interconnect_bandwidth=300e9),
    "a100-80gb": HardwareSpec("a100-80gb", matmul_flops=312e12, memory_bandwidth=2.039e12,
                              host_link_bandwidth=25e9, memory_bytes=80e9, interconnect_bandwidth=300e9),
    # Nodes: AWS p5.48xlarge, 3,200 Gbps EFA (aws.amazon.com/ec2/instance-types/p5/) = 400 GB/s.
    "h100": HardwareSpec("h100", matmul_flops=989e12, memory_bandwidth=3.35e12,
                         host_link_bandwidth=50e9, memory_bytes=80e9, interconnect_bandwidth=450e9,
                         pcie_bandwidth=64e9, node_link_bandwidth=400e9),
    "v100": HardwareSpec("v100", matmul_flops=125e12, memory_bandwidth=0.9e12,
                         host_link_bandwidth=12e9, memory_bytes=32e9, interconnect_bandwidth=150e9,
                         pcie_bandwidth=16e9),
    "a10": HardwareSpec("a10", matmul_flops=125e12, memory_bandwidth=0.6e12,
                        host_link_bandwidth=25e9, memory_bytes=24e9, interconnect_bandwidth=32e9,
                        allreduce_latency_s=30e-6, nvlink=False),
    # FastSwitch's single-GPU setting (§4): an A10 on PCIe 4.0 x16 taken at its 32 GB/s peak, with
    # 10 us per copy call, the cost block groups amortise (FastSwitch §3.1).
    "a10-24gb": HardwareSpec("a10-24gb", matmul_flops=125e12, memory_bandwidth=0.6e12,
                             host_link_bandwidth=32e9, memory_bytes=24e9, interconnect_bandwidth=32e9,
                             allreduce_latency_s=30e-6, nvlink=False, transfer_op_overhead_s=10e-6),
}
# GPU<->GPU links a cost model spec may name (":nvlink" / ":pcie"); none: the card's own.
LINKS = ("nvlink", "pcie")
# Share of each GPU's memory the engine may fill with weights and KV (vLLM's gpu_memory_utilization).
MEMORY_FRACTION = 0.9

_LLAMA_3_8B = ModelSpec("llama-3-8b", num_params=8.03e9, num_layers=32, hidden_size=4096, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                        gated_mlp=True, tied_embeddings=False)

# Public Hugging Face configs (OPT: facebook/opt-*, Llama: meta-llama/*, Qwen: Qwen/Qwen2.5-*).
MODEL_SPECS: dict[str, ModelSpec] = {
    "opt-13b": ModelSpec("opt-13b", num_params=12.85e9, num_layers=40, hidden_size=5120, num_heads=40,
                         num_kv_heads=40, head_dim=128, intermediate_size=20480, vocab_size=50272),
    "opt-66b": ModelSpec("opt-66b", num_params=65.7e9, num_layers=64, hidden_size=9216, num_heads=72,
                         num_kv_heads=72, head_dim=128, intermediate_size=36864, vocab_size=50272),
    "opt-175b": ModelSpec("opt-175b", num_params=175e9, num_layers=96, hidden_size=12288, num_heads=96,
                          num_kv_heads=96, head_dim=128, intermediate_size=49152, vocab_size=50272),
    "llama-2-7b": ModelSpec("llama-2-7b", num_params=6.74e9, num_layers=32, hidden_size=4096, num_heads=32,
                            num_kv_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000,
                            gated_mlp=True, tied_embeddings=False),
    "llama-2-13b": ModelSpec("llama-2-13b", num_params=13.0e9, num_layers=40, hidden_size=5120, num_heads=40,
                             num_kv_heads=40, head_dim=128, intermediate_size=13824, vocab_size=32000,
                             gated_mlp=True, tied_embeddings=False),
    "llama-3-8b": _LLAMA_3_8B,
    # FastSwitch's models (§4): Llama-3-8B under the paper's name, and Qwen2.5-32B.
    "llama-8b": replace(_LLAMA_3_8B, name="llama-8b"),
    "qwen-32b": ModelSpec("qwen-32b", num_params=32.5e9, num_layers=64, hidden_size=5120, num_heads=40,
                          num_kv_heads=8, head_dim=128, intermediate_size=27648, vocab_size=152064,
                          gated_mlp=True, tied_embeddings=False),
}

# Kernels launched per decoder layer without CUDA graphs: 2 norms, qkv, rotary/cache write,
# attention, out-proj, 2-3 MLP matmuls, activation, residual adds.
KERNELS_PER_LAYER = 10


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
        kind = data.get("kind")
        if kind == "roofline":
            return RooflineCostModel.from_dict(data)
        if kind == "profile":
            return ProfileCostModel.from_dict(data)
        raise ValueError(f"unknown cost model kind {kind!r}; expected 'roofline' or 'profile'")


class RooflineCostModel(CostModel):
    """Analytic cost from FLOPs and bytes against a hardware roofline (see module doc)."""

    kind = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int = 1,
                 link: str | None = None, pipeline_parallel: int = 1) -> None:
        """`link`: the GPU<->GPU link tensor parallelism uses, one of LINKS; None: the card's own.
        `pipeline_parallel`: stages of `tensor_parallel` GPUs each, a contiguous share of the layers."""
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        if not 1 <= pipeline_parallel <= model.num_layers:
            raise ValueError(f"pipeline_parallel must be in [1, {model.num_layers}] (the layers of "
                             f"{model.name}), got {pipeline_parallel}")
        if link is not None and link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose from {', '.join(LINKS)}")
        if link == "nvlink" and not hardware.nvlink:
            raise ValueError(f"{hardware.name} has no NVLink; its GPUs talk over PCIe")
        self.model = model
        self.hardware = hardware
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.link = link or ("nvlink" if hardware.nvlink else "pcie")
        # Each GPU copies its own KV shard over its own host link, so links add up.
        self.transfer = TransferSpec(hardware.host_link_bandwidth * tensor_parallel * pipeline_parallel,
                                     hardware.transfer_op_overhead_s)
        self._constants()

    @property
    def name(self) -> str:
        suffix = f":tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        suffix += f":pp{self.pipeline_parallel}" if self.pipeline_parallel > 1 else ""
        if self.tensor_parallel > 1 and self.link == "pcie" and self.hardware.nvlink:
            suffix += ":pcie"  # only a link other than the card's own is named
        return f"{self.model.name}@{self.hardware.name}{suffix}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def _op_seconds(self, flops: float, num_bytes: float) -> float:
        return max(flops / self._flop_rate, num_bytes / self._byte_rate)

    def _constants(self) -> None:
        """Per-model numbers every iteration needs; the simulator calls iteration_seconds
        millions of times, so they are worked out once."""
        m, hw, tp = self.model, self.hardware, self.tensor_parallel
        self._flop_rate = hw.matmul_flops * hw.compute_efficiency
        self._byte_rate = hw.memory_bandwidth * hw.memory_efficiency
        self._dense_flops_per_token = 2.0 * m.layer_params / tp
        self._dense_bytes = m.layer_params * m.bytes_per_param / tp
        self._attn_flops_per_pair = 4.0 * (m.num_heads * m.head_dim / tp)
        self._kv_bytes_per_token_layer = 2 * max(m.num_kv_heads / tp, 1) * m.head_dim * m.kv_bytes_per_value
        head_params = m.vocab_size * m.hidden_size / tp
        self._head_flops_per_seq = 2.0 * head_params
        self._head_bytes = head_params * m.bytes_per_param
        self._fixed_per_layer = KERNELS_PER_LAYER * hw.op_overhead_s
        pcie = self.link == "pcie" and hw.nvlink
        link_bw = hw.pcie_bandwidth if pcie else hw.interconnect_bandwidth
        self._link_latency = hw.pcie_allreduce_latency_s if pcie else hw.allreduce_latency_s
        # Ring collectives: an all-reduce moves 2(t-1)/t of the data over each GPU's link, an
        # all-gather (t-1)/t; seconds per byte of the full tensor.
        self._allreduce_s_per_byte = 2 * (tp - 1) / tp / link_bw
        self._gather_s_per_byte = (tp - 1) / tp / link_bw
        self._act_bytes_per_token = m.hidden_size * m.bytes_per_param
        self._logit_bytes_per_seq = m.vocab_size * m.bytes_per_param
        # Pipeline stages: contiguous layer ranges, the first ones one layer longer when uneven.
        pp = self.pipeline_parallel
        self._stage_layers = [m.num_layers // pp + (i < m.num_layers % pp) for i in range(pp)]
        # Stage to stage: a TP group's activations go once (Megatron-LM's scatter/gather, Narayanan
        # et al. 2021 §4.1); over the server's network when the stages do not fit one node.
        across_nodes = tp * pp > hw.gpus_per_node
        self._p2p_s_per_byte = 1.0 / (hw.node_link_bandwidth if across_nodes else link_bw)
        self._p2p_latency = hw.node_link_latency_s if across_nodes else self._link_latency

    def iteration_seconds(self, shape: BatchShape) -> float:
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return 0.0
        if self.pipeline_parallel > 1:
            return sum(self.stage_seconds(shape)) + (self.pipeline_parallel - 1) * self.p2p_seconds(tokens)
        m, hw, tp = self.model, self.hardware, self.tensor_parallel
        per_layer, head, seqs = self._layer_and_head(shape, tokens)
        comm = self.tp_comm_seconds(tokens, seqs) if tp > 1 else 0.0
        return m.num_layers * per_layer + head + comm + hw.iteration_overhead_s

    def stage_seconds(self, shape: BatchShape) -> list[float]:
        """Each stage: its layers with their two all-reduces each; the first adds the embedding's
        all-reduce, the last the LM head, its logits gather and the per-iteration overhead."""
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return [0.0] * self.pipeline_parallel
        per_layer, head, seqs = self._layer_and_head(shape, tokens)
        allreduce, gather = self._collectives(tokens, seqs) if self.tensor_parallel > 1 else (0.0, 0.0)
        out = [n * (per_layer + 2 * allreduce) for n in self._stage_layers]
        out[0] += allreduce
        out[-1] += head + gather + self.hardware.iteration_overhead_s
        return out

    def p2p_seconds(self, num_tokens: int) -> float:
        if self.pipeline_parallel == 1 or num_tokens <= 0:
            return 0.0
        return self._p2p_latency + num_tokens * self._act_bytes_per_token * self._p2p_s_per_byte

    def _layer_and_head(self, shape: BatchShape, tokens: int) -> tuple[float, float, int]:
        """(one decoder layer's seconds on one GPU, the LM head's, sequences sampled)."""
        # Dense matmuls: weights are read once per iteration however many tokens share them, which
        # is why batching decode is nearly free until the batch becomes compute-bound.
        dense = self._op_seconds(self._dense_flops_per_token * tokens, self._dense_bytes)
        # Attention: QK^T and AV cost 4*d FLOPs per (query, key) pair; K and V are read per context
        # token and written for each new token. KV heads are split across GPUs (replicated if fewer).
        attn = self._op_seconds(self._attn_flops_per_pair * (shape.context_tokens + shape.prefill_context),
                                self._kv_bytes_per_token_layer * (shape.context_tokens + tokens))
        seqs = shape.prefill_seqs + shape.decode_seqs
        per_layer = dense + attn + self._fixed_per_layer
        # LM head: one logits row per sampled sequence, but the whole vocab matrix is read.
        head = self._op_seconds(self._head_flops_per_seq * seqs, self._head_bytes)
        return per_layer, head, seqs

    def tp_comm_seconds(self, tokens: int, seqs: int) -> float:
        """Tensor-parallel communication of one iteration (Megatron-LM §3): the vocab-parallel
        embedding's all-reduce, two all-reduces per layer (after the row-parallel attention output
        and MLP down projections), and the vocab-parallel LM head's gather of each sampled
        sequence's logits. 0.0 at tp1."""
        if self.tensor_parallel == 1 or tokens == 0:
            return 0.0
        allreduce, gather = self._collectives(tokens, seqs)
        return (2 * self.model.num_layers + 1) * allreduce + gather

    def _collectives(self, tokens: int, seqs: int) -> tuple[float, float]:
        """(one all-reduce of the step's activations, the gather of its logits rows)."""
        act = tokens * self._act_bytes_per_token
        allreduce = self._link_latency + act * self._allreduce_s_per_byte
        gather = self._link_latency + seqs * self._logit_bytes_per_seq * self._gather_s_per_byte
        return allreduce, gather

    def transfer_seconds(self, num_bytes: int, num_ops: int = 1) -> float:
        return self.transfer.seconds(num_bytes, num_ops)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def weight_bytes_per_gpu(self) -> float:
        """Each GPU holds 1/TP of its stage's 1/PP share of the weights."""
        return self.model.derived_params * self.model.bytes_per_param / self.num_gpus

    def kv_capacity_tokens(self, memory_fraction: float = MEMORY_FRACTION) -> int:
        """Tokens of KV that fit beside the weights in `memory_fraction` of each GPU's memory."""
        free = self.hardware.memory_bytes * memory_fraction - self.weight_bytes_per_gpu()
        per_token_per_gpu = self.kv_bytes_per_token / self.num_gpus
        return max(int(free // per_token_per_gpu), 0)

    def check_fits(self) -> None:
        """ValueError unless each GPU holds its weight shard with room left for KV."""
        if self.kv_capacity_tokens() > 0:
            return
        hw = self.hardware
        need = self.weight_bytes_per_gpu() / 1e9
        # More GPUs: tensor parallel inside a node first, then pipeline stages across nodes (FastServe §5).
        options = [(min(g, hw.gpus_per_node), max(g // hw.gpus_per_node, 1)) for g in (2, 4, 8, 16, 32, 64)]
        fits = next((f":tp{t}" + (f":pp{p}" if p > 1 else "") for t, p in options if t * p > self.num_gpus and
                     RooflineCostModel(self.model, hw, t, self.link, p).kv_capacity_tokens() > 0), None)
        hint = f"; shard it over more GPUs, e.g. {self.model.name}@{hw.name}{fits}" if fits else ""
        raise ValueError(f"{self.name} does not fit: {need:.1f} GB of weights per GPU leave no room for KV "
                         f"in {MEMORY_FRACTION:.0%} of the {hw.memory_bytes / 1e9:.0f} GB of one "
                         f"{hw.name}{hint}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "model": asdict(self.model),
                "hardware": asdict(self.hardware), "tensor_parallel": self.tensor_parallel, "link": self.link,
                "pipeline_parallel": self.pipeline_parallel}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RooflineCostModel:
        return cls(ModelSpec(**_known_fields(ModelSpec, data["model"])),
                   HardwareSpec(**_known_fields(HardwareSpec, data["hardware"])),
                   int(data.get("tensor_parallel", 1)), data.get("link"), int(data.get("pipeline_parallel", 1)))


# Feature order of the fitted profile; names are the JSON coefficient keys.
PROFILE_FEATURES = ("base", "prefill_tokens", "decode_seqs", "context_tokens", "prefill_context",
                    "prefill_seqs", "has_prefill", "has_decode")
# Profiles written before the last three existed load with those terms at zero.
OPTIONAL_FEATURES = ("prefill_seqs", "has_prefill", "has_decode")


def profile_features(shape: BatchShape) -> list[float]:
    """[1, prefill tokens, decode seqs, context tokens, prefill attention pairs] (ALISE §3.1), plus
    per-prefill-chunk and per-attention-group terms: the engine runs prefill and decode attention
    as separate groups, whose fixed costs dominate a small model's step."""
    return [1.0, float(shape.prefill_tokens), float(shape.decode_seqs), float(shape.context_tokens),
            float(shape.prefill_context), float(shape.prefill_seqs), float(shape.prefill_seqs > 0),
            float(shape.decode_seqs > 0)]


# The engine loop's own time per step (`loop_seconds`), fitted on step traces; JSON key "loop".
# Profiles without it (synthetic sweeps, older files) have every term at zero.
LOOP_FEATURES = ("base", "live", "sampled", "arrivals")


def loop_features(loop: LoopShape) -> list[float]:
    return [1.0, float(loop.live), float(loop.sampled), float(loop.arrivals)]


class ProfileCostModel(CostModel):
    """Linear cost fitted to iterations measured on this machine (see `fit_profile`)."""

    kind = "profile"

    def __init__(self, coefficients: dict[str, float], transfer: TransferSpec, kv_bytes_per_token: int,
                 model: str = "unknown", device: str = "unknown", samples: int = 0,
                 r2: float | None = None, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 p2p: TransferSpec | None = None, activation_bytes_per_token: int = 0,
                 loop: dict[str, float] | None = None, stage_factors: list[float] | None = None,
                 stage_cv: list[float] | None = None) -> None:
        """`tensor_parallel`: GPUs the measured engine sharded the model over (its iteration times
        include their collectives; KV bytes per token are the whole model's).
        `pipeline_parallel`: stages the measured pass went through, one batch at a time; a stage
        takes an equal share of it less the sends between stages, each `p2p` (per send, per byte)
        for `activation_bytes_per_token` bytes a token. `stage_factors`: each stage's time as a
        multiple of that equal share (default 1 each), fitted to a real pipeline's stage timers: a
        split even in layers but not in time (the LM head), stages slowed by sharing cores;
        `stage_cv` their measured per-batch spread (std / mean, default 0): with as many batches in
        flight as stages there is no slack, so a late stage stalls the next one.
        `loop`: coefficients over LOOP_FEATURES (missing ones are 0)."""
        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise ValueError(f"tensor_parallel and pipeline_parallel must be >= 1, got {tensor_parallel}, "
                             f"{pipeline_parallel}")
        missing = [k for k in PROFILE_FEATURES if k not in coefficients and k not in OPTIONAL_FEATURES]
        if missing:
            raise ValueError(f"profile coefficients missing {missing}; need {list(PROFILE_FEATURES)}")
        self.coefficients = {k: float(coefficients.get(k, 0.0)) for k in PROFILE_FEATURES}
        self._weights = np.array([self.coefficients[k] for k in PROFILE_FEATURES])
        self.transfer = transfer
        self._kv_bytes_per_token = int(kv_bytes_per_token)
        self.model = model
        self.device = device
        self.samples = samples
        self.r2 = r2
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.p2p = p2p or TransferSpec(float("inf"), 0.0)
        self.activation_bytes_per_token = int(activation_bytes_per_token)
        unknown = set(loop or {}) - set(LOOP_FEATURES)
        if unknown:
            raise ValueError(f"unknown loop terms {sorted(unknown)}; expected {list(LOOP_FEATURES)}")
        self.loop = {k: float((loop or {}).get(k, 0.0)) for k in LOOP_FEATURES}
        self._loop_weights = np.array([self.loop[k] for k in LOOP_FEATURES])
        self.stage_factors = [float(f) for f in stage_factors] if stage_factors else [1.0] * pipeline_parallel
        if len(self.stage_factors) != pipeline_parallel or min(self.stage_factors) <= 0:
            raise ValueError(f"stage_factors must be {pipeline_parallel} positive numbers, got {stage_factors}")
        self._stages_fitted = self.stage_factors != [1.0] * pipeline_parallel
        self.stage_cv = [float(c) for c in stage_cv] if stage_cv else [0.0] * pipeline_parallel
        if len(self.stage_cv) != pipeline_parallel or min(self.stage_cv) < 0:
            raise ValueError(f"stage_cv must be {pipeline_parallel} numbers >= 0, got {stage_cv}")

    @property
    def name(self) -> str:
        suffix = f":tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        suffix += f":pp{self.pipeline_parallel}" if self.pipeline_parallel > 1 else ""
        return f"{self.model}@{self.device}{suffix}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    def iteration_seconds(self, shape: BatchShape) -> float:
        if shape.is_empty():
            return 0.0
        if self._stages_fitted:  # the fitted stages, not the measured pass
            return sum(self.stage_seconds(shape)) + (self.pipeline_parallel - 1) * self.p2p_seconds(shape.num_tokens)
        return self._pass_seconds(shape)

    def _pass_seconds(self, shape: BatchShape) -> float:
        return max(float(np.dot(self._weights, profile_features(shape))), 0.0)

    def stage_seconds(self, shape: BatchShape) -> list[float]:
        m = self.pipeline_parallel
        compute = max(self._pass_seconds(shape) - (m - 1) * self.p2p_seconds(shape.num_tokens), 0.0)
        return [f * compute / m for f in self.stage_factors]

    def p2p_seconds(self, num_tokens: int) -> float:
        if self.pipeline_parallel == 1 or num_tokens <= 0:
            return 0.0
        return self.p2p.seconds(num_tokens * self.activation_bytes_per_token)

    def stage_spread(self) -> list[float]:
        return list(self.stage_cv)

    def transfer_seconds(self, num_bytes: int, num_ops: int = 1) -> float:
        return self.transfer.seconds(num_bytes, num_ops)

    @property
    def has_loop_cost(self) -> bool:
        return any(self.loop.values())

    def loop_seconds(self, loop: LoopShape) -> float:
        if not self.has_loop_cost:
            return 0.0
        return max(float(np.dot(self._loop_weights, loop_features(loop))), 0.0)

    def to_dict(self) -> dict[str, Any]:
        pipeline = {} if self.pipeline_parallel == 1 else {
            "pipeline_parallel": self.pipeline_parallel, "activation_bytes_per_token": self.activation_bytes_per_token,
            "p2p": {"bytes_per_s": self.p2p.bytes_per_s, "op_overhead_s": self.p2p.op_overhead_s},
            "stage_factors": list(self.stage_factors), "stage_cv": list(self.stage_cv)}
        return {"kind": self.kind, "model": self.model, "device": self.device,
                "coefficients": dict(self.coefficients), "loop": dict(self.loop),
                "transfer": {"bytes_per_s": self.transfer.bytes_per_s, "op_overhead_s": self.transfer.op_overhead_s},
                "kv_bytes_per_token": self.kv_bytes_per_token, "samples": self.samples, "r2": self.r2,
                "tensor_parallel": self.tensor_parallel, **pipeline}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileCostModel:
        t, p2p = data["transfer"], data.get("p2p")
        return cls(coefficients=data["coefficients"],
                   transfer=TransferSpec(float(t["bytes_per_s"]), float(t["op_overhead_s"])),
                   kv_bytes_per_token=int(data["kv_bytes_per_token"]), model=data.get("model", "unknown"),
                   device=data.get("device", "unknown"), samples=int(data.get("samples", 0)), r2=data.get("r2"),
                   tensor_parallel=int(data.get("tensor_parallel", 1)),
                   pipeline_parallel=int(data.get("pipeline_parallel", 1)),
                   p2p=TransferSpec(float(p2p["bytes_per_s"]), float(p2p["op_overhead_s"])) if p2p else None,
                   activation_bytes_per_token=int(data.get("activation_bytes_per_token", 0)), loop=data.get("loop"),
                   stage_factors=data.get("stage_factors"), stage_cv=data.get("stage_cv"))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, min ||a x - b|| s.t. x >= 0 (Lawson-Hanson active set).

    Written here because scipy is not a dependency; the problems are tiny (5 columns).
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    max_iter = max_iter or 3 * n + 10
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            # Step back toward x until the first passive variable hits zero, then drop it.
            bad = passive & (s <= 0)
            alpha = np.min(x[bad] / (x[bad] - s[bad]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                s = np.zeros(n)
                break
        x = s
        w = a.T @ (b - a @ x)
    return x


def fit_transfer(samples: Sequence[tuple[int, int, float]]) -> TransferSpec:
    """Fit seconds = ops * overhead + bytes / bandwidth to measured (bytes, ops, seconds) copies."""
    if len(samples) < 2:
        raise ValueError("fit_transfer needs at least 2 samples (bytes, ops, seconds)")
    a = np.array([[float(ops), float(nb)] for nb, ops, _ in samples])
    y = np.array([float(s) for _, _, s in samples])
    scale = np.where(np.linalg.norm(a, axis=0) > 0, np.linalg.norm(a, axis=0), 1.0)
    overhead, inv_bw = nnls(a / scale, y) / scale
    if inv_bw <= 0:
        raise ValueError("transfer samples show no dependence on bytes; cannot fit a bandwidth")
    return TransferSpec(bytes_per_s=1.0 / inv_bw, op_overhead_s=float(overhead))


def fit_profile(samples: Sequence[tuple[BatchShape, float]], *, kv_bytes_per_token: int,
                transfer: TransferSpec | Sequence[tuple[int, int, float]] | None = None,
                model: str = "unknown", device: str = "unknown", tensor_parallel: int = 1) -> ProfileCostModel:
    """Least-squares fit of iteration seconds on PROFILE_FEATURES with non-negative coefficients.

    Non-negativity keeps the model monotone (more work never predicts less time), which the
    policies rely on. `transfer` is a measured TransferSpec, raw (bytes, ops, seconds) samples to
    fit one from, or None for a PCIe gen4 default (25 GB/s, 10 us per copy).
    """
    if len(samples) < len(PROFILE_FEATURES):
        raise ValueError(f"fit_profile needs at least {len(PROFILE_FEATURES)} samples, got {len(samples)}")
    a = np.array([profile_features(shape) for shape, _ in samples])
    y = np.array([float(s) for _, s in samples])
    # Columns span ~1 to ~1e6: normalise so the solver's tolerance means the same for each.
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    coef = nnls(a / scale, y) / scale
    resid = y - a @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    if transfer is None:
        transfer_spec = TransferSpec(25e9, 10e-6)
    elif isinstance(transfer, TransferSpec):
        transfer_spec = transfer
    else:
        transfer_spec = fit_transfer(transfer)
    return ProfileCostModel(coefficients=dict(zip(PROFILE_FEATURES, (float(c) for c in coef))),
                            transfer=transfer_spec, kv_bytes_per_token=kv_bytes_per_token, model=model,
                            device=device, samples=len(samples), r2=r2, tensor_parallel=tensor_parallel)


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def known_cost_models() -> list[str]:
    """Every built-in "model@hardware" name."""
    return [f"{m}@{h}" for m in MODEL_SPECS for h in HARDWARE_SPECS]


def load_cost_model(spec: str) -> CostModel:
    """A cost model from "model@hardware[:tpN][:ppM][:nvlink|:pcie]" (e.g. "opt-13b@a100-40gb",
    "opt-66b@a100-40gb:tp4:pcie", "opt-175b@a100-40gb:tp8:pp2") or a JSON file path. The link
    defaults to the card's own; pipeline stages beyond one node talk over the node's network."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"cost model profile {spec!r} does not exist")
        return CostModel.from_dict(json.loads(path.read_text()))
    text, *options = spec.strip().lower().split(":")
    degrees, link = {"tp": 1, "pp": 1}, None
    for part in options:
        if part in LINKS:
            link = part
        elif part[:2] in degrees and part[2:].isdigit() and int(part[2:]) >= 1:
            degrees[part[:2]] = int(part[2:])
        else:
            raise ValueError(f"bad suffix {part!r} in {spec!r}; use ':tpN' (tensor-parallel degree), ':ppM' "
                             f"(pipeline stages) and optionally a link, {' or '.join(':' + k for k in LINKS)} "
                             f"(e.g. ':tp4:pcie', ':tp8:pp2')")
    model_name, at, hw_name = text.partition("@")
    if not at or model_name not in MODEL_SPECS or hw_name not in HARDWARE_SPECS:
        problem = (f"unknown model {model_name!r}" if at and model_name not in MODEL_SPECS else
                   f"unknown hardware {hw_name!r}" if at else "expected 'model@hardware' or a .json profile")
        raise ValueError(f"cannot load cost model {spec!r}: {problem}. Models: {', '.join(MODEL_SPECS)}; "
                         f"hardware: {', '.join(HARDWARE_SPECS)} (e.g. opt-13b@a100-40gb, "
                         f"opt-66b@a100-80gb:tp4)")
    return RooflineCostModel(MODEL_SPECS[model_name], HARDWARE_SPECS[hw_name], degrees["tp"], link, degrees["pp"])
