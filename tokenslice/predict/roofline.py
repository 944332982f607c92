"""RooflineCostModel: analytic iteration and transfer time (docs/DESIGN.md, "CostModel").

A `ModelSpec` on a `HardwareSpec` (specs.py). Each layer is two roofline
operations (dense matmuls against the weights, attention against the KV cache); an operation
takes max(FLOPs / compute rate, bytes / memory bandwidth), plus fixed kernel-launch and
per-iteration overheads. Efficiency factors are calibrated so that opt-13b on an A100-40GB
decodes one sequence in ~23 ms and prefills a lone 512-token prompt in ~80 ms, the reference
values the project's targets quote. With tensor parallelism (`:tpN`) every GPU computes and
reads 1/N of the weights and KV, and the iteration pays Megatron-style ring collectives over
the GPU link (`tp_comm_seconds`; `:nvlink` or `:pcie`, default the card's own). With pipeline
parallelism (`:ppM`) the layers split into M stages of TP groups (`stage_seconds`), and a
batch's activations cross each stage boundary point to point (`p2p_seconds`): over the GPU
link when all stages fit one node, over the node's network otherwise.
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from tokenslice.predict.cost import BatchShape, CostModel, TransferSpec
from tokenslice.predict.specs import HARDWARE_SPECS, LINKS, MEMORY_FRACTION, MODEL_SPECS, HardwareSpec, ModelSpec

# Kernels launched per decoder layer without CUDA graphs: 2 norms, qkv, rotary/cache write,
# attention, out-proj, 2-3 MLP matmuls, activation, residual adds.
KERNELS_PER_LAYER = 10


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


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def roofline_from_spec(spec: str) -> RooflineCostModel:
    """The roofline cost model "model@hardware[:tpN][:ppM][:nvlink|:pcie]" names (see `load_cost_model`)."""
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
