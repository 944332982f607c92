"""A Hugging Face config.json reduced to what the model code needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
OPT_FAMILY = {"OPTForCausalLM": "opt"}
SUPPORTED_ARCHITECTURES = tuple(LLAMA_FAMILY) + tuple(OPT_FAMILY)


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass
class ArchConfig:
    architecture: str
    family: str  # llama | qwen2 | mistral | opt
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "silu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    final_layer_norm: bool = True
    layer_norm_affine: bool = True
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def matmul_params(self) -> int:
        """Weights each token multiplies: the layers' linears and the LM head (a quantized model's
        as many as the dense one's)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * q + 2 * self.hidden_size * kv
        mlp = (2 if self.family == "opt" else 3) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.hidden_size * self.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token across all layers at 4-byte precision; scale by element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def parse_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        if arch in OPT_FAMILY:
            return _parse_opt(cfg, arch)
        return _parse_llama(cfg, arch)
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing field {e.args[0]!r} needed by {arch}") from None


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters; older files keep both.
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def _parse_llama(cfg: dict[str, Any], arch: str) -> ArchConfig:
    family = LLAMA_FAMILY[arch]
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    theta, scaling = _rope(cfg)
    qkv_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
    return ArchConfig(
        architecture=arch, family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        hidden_act=cfg.get("hidden_act", "silu"), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, qkv_bias=qkv_bias,
        o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), raw=cfg)


def _parse_opt(cfg: dict[str, Any], arch: str) -> ArchConfig:
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    pre = bool(cfg.get("do_layer_norm_before", True))
    return ArchConfig(
        architecture=arch, family="opt", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=cfg["ffn_dim"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        hidden_act=cfg.get("activation_function", "relu"), norm_eps=1e-5,
        qkv_bias=bool(cfg.get("enable_bias", True)), o_bias=bool(cfg.get("enable_bias", True)),
        mlp_bias=bool(cfg.get("enable_bias", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        do_layer_norm_before=pre, word_embed_proj_dim=cfg.get("word_embed_proj_dim") or hidden,
        final_layer_norm=pre and not cfg.get("_remove_final_layer_norm", False),
        layer_norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)), raw=cfg)
