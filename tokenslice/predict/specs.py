"""The built-in hardware and models the roofline cost model prices (roofline.py), from public
datasheets and model configs; a cost model spec names one of each ("opt-13b@a100-40gb")."""
from __future__ import annotations

from dataclasses import dataclass, replace


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
    compute_efficiency: float = 0.54  # achieved / peak FLOP/s (calibrated, see roofline.py)
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



def known_cost_models() -> list[str]:
    """Every built-in "model@hardware" name."""
    return [f"{m}@{h}" for m in MODEL_SPECS for h in HARDWARE_SPECS]
