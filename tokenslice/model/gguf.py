"""GGUF checkpoints (llama.cpp's one-file format): the hyper-parameters, the weights and the
tokenizer of a llama-family model from one file. Weights are dequantized to floats here; the
precision each Linear weight had in the file is kept for the quantization plan (model/quant.py).
Every failure names the file and the problem."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tokenslice.model.arch import ArchConfig, ModelLoadError, parse_config

# general.architecture -> the Hugging Face architecture whose code runs it (model/llama.py).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's converter interleaves the two rotary halves of every q and k head for its rope kernel
# (convert_hf_to_gguf.py, LlamaModel.permute); Qwen2 it writes as Hugging Face has it.
PERMUTED_QK = {"llama"}

Q = GGMLQuantizationType
# The precision a weight keeps in the quantization plan (config.py QUANTIZATIONS): up to 4 bits
# as int4; 5 to 8 bits as int8, which holds them without losing what the file had.
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS)
INT8_TYPES = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
SUPPORTED_TYPES = INT4_TYPES + INT8_TYPES + FLOAT_TYPES

# GGUF tensor names (llama.cpp's gguf-py constants.py TENSOR_NAMES) -> Hugging Face names.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the metadata's many small reads
    (one per vocabulary string) skip np.memmap's per-slice overhead, 2-3x faster to open."""

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = np.asarray(value)


@dataclass
class GGUFWeight:
    """One tensor of the file, under the model's (Hugging Face) name; `read` dequantizes it."""
    name: str
    shape: tuple[int, ...]  # torch order: [out, in] for a Linear weight
    type_name: str  # GGML type, e.g. Q4_1
    precision: str | None  # int4 | int8 | None (a float type)
    read: Callable[[], torch.Tensor]


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def open_gguf(path: Path) -> GGUFReader:
    """The file's metadata and tensor index; refuses architectures model/llama.py does not run."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFArrayReader(path)
    except (ValueError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return reader


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """The config.json that the file's metadata describes (the keys transformers' GGUF loader
    reads, integrations/ggml.py GGUF_CONFIG_MAPPING)."""
    arch = metadata(reader, "general.architecture")

    def key(name: str, default: Any = None) -> Any:
        return metadata(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: per-frequency rope factors (rope_freqs, Llama 3.1 scaling) are not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    heads, hidden = key("attention.head_count"), key("embedding_length")
    if heads is None or hidden is None:
        raise ModelLoadError(f"{path}: metadata lacks {arch}.attention.head_count or {arch}.embedding_length")
    head_dim = key("attention.key_length", hidden // heads)  # set where it is not hidden / heads (Mistral Nemo)
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: rotary embedding on {rope_dim} of {head_dim} head dims is not supported")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(embed.shape[-1]), "hidden_size": hidden, "num_attention_heads": heads,
        "num_hidden_layers": key("block_count"), "intermediate_size": key("feed_forward_length"),
        "num_key_value_heads": key("attention.head_count_kv", heads), "head_dim": head_dim,
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5), "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in tensors,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling!r}; supported: none, linear")
    missing = [k for k, v in raw.items() if v is None and not k.endswith("token_id")]
    if missing:
        raise ModelLoadError(f"{path}: metadata lacks what {arch} needs: {', '.join(missing)}")
    return raw


def gguf_arch(reader: GGUFReader, path: Path) -> ArchConfig:
    return parse_config(gguf_config(reader, path), str(path))


def checkpoint_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for one the model has no place for."""
    base, _, kind = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and kind == "weight":
        return f"{GLOBAL_NAMES[base]}.weight"
    m = _LAYER_TENSOR.match(gguf_name)
    if m is None or m.group(2) not in LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def source_precision(tensor_type: GGMLQuantizationType) -> str | None:
    return "int4" if tensor_type in INT4_TYPES else "int8" if tensor_type in INT8_TYPES else None


def gguf_weights(reader: GGUFReader, arch: ArchConfig, path: Path) -> Iterator[GGUFWeight]:
    """Every tensor of the file, under its Hugging Face name (its GGUF name if it has none);
    nothing is dequantized until its `read` is called."""
    permute = metadata(reader, "general.architecture") in PERMUTED_QK
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which is not supported; "
                                 f"supported: {', '.join(q.name for q in SUPPORTED_TYPES)}")
        name = checkpoint_name(t.name) or t.name
        heads = (arch.num_heads if ".q_proj." in name else arch.num_kv_heads if ".k_proj." in name else 0) if permute else 0
        yield GGUFWeight(name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name,
                         source_precision(t.tensor_type), lambda t=t, heads=heads: _read(t, heads))


def _read(tensor: Any, rotary_heads: int) -> torch.Tensor:
    values = dequantize(tensor.data, tensor.tensor_type)
    if not values.flags.writeable:  # a float tensor is a view of the read-only file map
        values = values.copy()
    out = torch.from_numpy(values).reshape(tuple(int(n) for n in reversed(tensor.shape)))
    return _unpermute_rotary(out, rotary_heads) if rotary_heads else out


def _unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (per head: pairs (i, i + d/2) side by side) back to the
    rotate-half order of Hugging Face checkpoints (as transformers' LlamaTensorProcessor does)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def gguf_tokenizer(path: Path) -> Any:
    """The fast tokenizer, special tokens and chat template the file's metadata describes
    (transformers builds it; the tokenizer class directly, since AutoTokenizer would first
    parse the whole file again for a config)."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; all mean the same to the user
        raise ModelLoadError(f"{path}: cannot build a tokenizer from its metadata ({type(e).__name__}: {e})") from None


def check_requantization(reader: GGUFReader, path: Path, mode: str) -> None:
    """Refuse --quantization int8/int4 over a file whose linears are quantized already: requantizing
    adds its error to the file's (SmolLM2's Q8_0 head as int4: 9% relative RMS error, and greedy
    replies change; its Q4_1 layers as int8: 1%), while auto keeps each tensor's own precision.
    Other modes (auto, none) pass."""
    if mode not in ("int8", "int4"):
        return
    tied = "output.weight" not in {t.name for t in reader.tensors}
    quantized = sorted({t.tensor_type.name for t in reader.tensors if source_precision(t.tensor_type) is not None
                        and (tied or t.name != "token_embd.weight")})  # an untied embedding is no linear
    if quantized:
        raise ModelLoadError(f"--quantization {mode}: {path.name} is quantized already ({', '.join(quantized)}); "
                             f"quantizing it again loses precision. Use --quantization auto to keep the file's own "
                             f"(Q4 as int4, Q8 as int8) or none to serve it in floats")
