"""Load a model from a local Hugging Face directory (config.json + *.safetensors + tokenizer),
a GGUF file (model/gguf.py), a known model's name (model/known_models.py) or the built-in tiny
model. Every failure names the file and the problem."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tokenslice.config import ModelConfig
from tokenslice.model.arch import ArchConfig, ModelLoadError, parse_config
from tokenslice.model.layers import onednn_packs_linears, use_input_major_linears
from tokenslice.model.builtin import BUILTIN_SEED, BUILTIN_TINY, builtin_config, builtin_tokenizer
from tokenslice.model.gguf import check_requantization, gguf_arch, gguf_tokenizer, gguf_weights, is_gguf, open_gguf
from tokenslice.model.known_models import check_model_source, check_tokenizer_source, resolve_model
from tokenslice.model.llama import LlamaForCausalLM
from tokenslice.model.opt import OPTForCausalLM
from tokenslice.model.pp import PPStage
from tokenslice.model.tp import TPShard, parallelize

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers and tensors some checkpoints carry that the model rebuilds itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class CheckpointTensor:
    """One tensor of a checkpoint file: its name, whole shape and a reader of it (a lazy
    safetensors slice, or the dequantized GGUF tensor)."""
    name: str
    shape: tuple[int, ...]
    read: Callable[[], Any]
    file: str  # for messages


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    tokenizer: Any  # a transformers tokenizer (None if not loaded)
    dtype: torch.dtype
    device: torch.device
    name: str
    # The precision each weight had in a GGUF file (int4 | int8 | None for floats), by parameter name.
    precision: dict[str, str | None] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def rank_device(name: str, rank: int) -> torch.device:
    """A tensor-parallel rank's device: its own GPU, cuda:rank, on CUDA; else the device."""
    device = resolve_device(name)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def resolve_dtype(name: str, arch: ArchConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32  # fp16 matmuls are slow on CPU; bf16 on request
        return torch.bfloat16 if arch.torch_dtype in (None, "float32", "bfloat16") else torch.float16
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    if name == "float16" and device.type == "cpu":
        raise ValueError("float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return DTYPES[name]


def build_model(arch: ArchConfig) -> nn.Module:
    return OPTForCausalLM(arch) if arch.family == "opt" else LlamaForCausalLM(arch)


def parameter_count(arch: ArchConfig) -> int:
    """The model's parameters (a tied head once), counted on a meta-device build of its architecture:
    the loaded module's own undercount a quantized model, whose linears keep packed buffers instead."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(arch).parameters())


def load_arch(cfg: ModelConfig) -> ArchConfig:
    """The checkpoint's config.json (a GGUF file's metadata, the built-in model's), without its weights."""
    if cfg.model == BUILTIN_TINY:
        return parse_config(builtin_config(), BUILTIN_TINY)
    check_model_source(cfg.model, "model")
    path = Path(resolve_model(cfg.model))
    if is_gguf(path):
        return gguf_arch(open_gguf(path), path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is neither a directory nor a .gguf file")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing; a Hugging Face model directory needs config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
    return parse_config(raw, str(cfg_file))


def load_model(cfg: ModelConfig, rank: int = 0, tp_size: int = 1, with_tokenizer: bool = True,
               stage: PPStage | None = None, group: Any = None, gpu: int | None = None) -> LoadedModel:
    """The model on its device, and its tokenizer unless `with_tokenizer` is False (seconds of
    imports that a worker process does without). With tp_size > 1, tensor-parallel rank `rank`'s
    share of it (model/tp.py; its collectives in `group`): only its slices of the weights are
    read, the result's `arch` is the share's (its heads, hence its KV partition). With a
    pipeline `stage` (model/pp.py), only that stage's layers, embedding or head, and `arch` has
    its layers. On CUDA a distributed rank lives on cuda:`gpu` (default: `rank`; a Ray actor
    sees only its own GPU, as cuda:0)."""
    path = Path(resolve_model(cfg.model))
    reader = open_gguf(path) if is_gguf(path) else None  # opened once: its metadata takes a second to parse
    if reader is not None:
        check_requantization(reader, path, cfg.quantization)
    arch = gguf_arch(reader, path) if reader is not None else load_arch(cfg)
    shard = TPShard(arch, rank, tp_size) if tp_size > 1 else None
    distributed = shard is not None or stage is not None
    device = (rank_device(cfg.device, rank if gpu is None else gpu) if distributed
              else resolve_device(cfg.device))
    local = shard.local_arch if shard is not None else arch
    if stage is not None:
        local = stage.local_arch(local)
    dtype = resolve_dtype(cfg.dtype, arch, device)
    if device.type != "cpu" and cfg.quantization in ("int8", "int4"):
        raise ValueError(f"quantization {cfg.quantization} runs on CPU only for now; on {device.type} use auto or none")
    with torch.device("meta"):
        model = build_model(local)
        if stage is not None:
            model.keep_stage(stage.is_first, stage.is_last)
    if device.type == "cuda":
        # Straight into device memory in the serving dtype: an 8B model built in float32 on the
        # host first would take 32 GB of RAM and a slow conversion.
        model = model.to(dtype=dtype).to_empty(device=device)
    else:  # float32 on the host: quantization (below) starts from the file's exact values
        model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each parameter fresh storage, which unties them
    precisions: dict[str, str | None] = {}  # a GGUF file's, per local parameter
    if cfg.model == BUILTIN_TINY:
        _copy_weights(model, _builtin_weights(arch), shard, stage)
    elif reader is not None:
        precisions = _load_gguf_weights(model, arch, reader, path, shard, stage)
    else:
        _load_weights(model, arch, path, shard, stage)
    tokenizer = model_tokenizer(cfg, arch) if with_tokenizer else None
    _rebuild_buffers(model, local)
    if shard is not None:
        parallelize(model, shard, group)
    plan = precisions if cfg.quantization == "auto" else None if cfg.quantization == "none" else cfg.quantization
    return LoadedModel(_finalize(model, device, dtype, plan), local, tokenizer, dtype, device, str(Path(cfg.model)),
                       precisions)


def _builtin_weights(arch: ArchConfig) -> nn.Module:
    """The built-in model's deterministic random weights, whole."""
    gen = torch.Generator().manual_seed(BUILTIN_SEED)
    with torch.device("meta"):
        model = build_model(arch)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return model


def _copy_weights(model: nn.Module, source: nn.Module, shard: TPShard | None, stage: PPStage | None) -> None:
    full = dict(source.named_parameters(remove_duplicate=False))  # a tied head keeps its name
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = full[stage.global_name(name) if stage is not None else name]
            p.copy_(shard.read(name, whole, tuple(p.shape)) if shard is not None else whole)


def _finalize(model: nn.Module, device: torch.device, dtype: torch.dtype,
              quantization: dict[str, str | None] | str | None = None) -> nn.Module:
    """On the device in `dtype`, fused; on CPU, linears quantized as `quantization` says (a plan
    per unfused parameter name, or one mode for all), the others input-major."""
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if hasattr(model, "fuse"):
        model.fuse()
    head = getattr(model, "lm_head", None)
    # The head's own weights, kept for float32 logprobs when its logits are not float32 (a quantized
    # head, a bf16 model); a tied head's are the embedding table's, which stays: no extra memory.
    head_weight = head.weight.detach() if type(head) is nn.Linear else None
    if device.type == "cpu":
        # A head tied to the embedding stays as is: transposing it would duplicate the table.
        tied = {id(head.weight)} if model.arch.tie_word_embeddings and head is not None else set()
        if quantization:
            _quantize(model, quantization)
        use_input_major_linears(model, tied, onednn_packs_linears(dtype))
    if head_weight is not None and (model.lm_head is not head or dtype != torch.float32):
        model.exact_head_weight = head_weight
    return model


def _quantize(model: nn.Module, quantization: dict[str, str | None] | str) -> None:
    """Weight-only quantized linears (model/quant.py), before any other layout takes them. A plan
    names checkpoint linears; quant.py finds the fused Linear that holds each after fuse()."""
    if isinstance(quantization, dict):
        linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        quantization = {name: mode for name, mode in quantization.items() if name in linears}
        if not any(quantization.values()):
            return
    from tokenslice.model.quant import quantize_linears

    log.info("%d linears quantized (weight-only)", quantize_linears(model, quantization))


def model_tokenizer(cfg: ModelConfig, arch: ArchConfig) -> Any:
    """The model's tokenizer (--tokenizer, else the model directory's or GGUF file's), checked
    against its vocabulary."""
    source = cfg.tokenizer or str(Path(cfg.model))
    if cfg.tokenizer:
        check_tokenizer_source(cfg.tokenizer, "tokenizer")
    tokenizer = load_tokenizer(source)
    if cfg.model != BUILTIN_TINY:
        check_vocab(tokenizer, arch, source, str(Path(cfg.model)))
    return tokenizer


def eos_token_ids(tokenizer: Any, arch: ArchConfig) -> list[int]:
    """The tokenizer's end-of-sequence ids (the model's when it names none); Llama 3 lists several."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else arch.eos_token_id
    return [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model directory, a GGUF file (its metadata's), a known model or builtin:tiny."""
    from transformers import AutoTokenizer

    if path == BUILTIN_TINY:
        return builtin_tokenizer()
    path = resolve_model(path)
    if is_gguf(path):
        return gguf_tokenizer(Path(path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; all mean the same to the user
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


def check_vocab(tokenizer: Any, arch: ArchConfig, tokenizer_source: str, model_source: str) -> None:
    """Every id the tokenizer can produce must have an embedding row. A smaller tokenizer is fine:
    checkpoints pad the vocabulary (Qwen2, OPT) and those rows are never fed in."""
    size = max(tokenizer.get_vocab().values(), default=-1) + 1
    if size > arch.vocab_size:
        raise ModelLoadError(
            f"tokenizer {tokenizer_source!r} has {size} tokens but model {model_source!r} has only {arch.vocab_size} "
            f"embedding rows (vocab_size); ids {arch.vocab_size}..{size - 1} would index past them. "
            f"Use the tokenizer made for this model")


def _rebuild_buffers(model: nn.Module, arch: ArchConfig) -> None:
    """Non-persistent buffers (rotary tables) were left empty by the meta-device build."""
    if isinstance(model, LlamaForCausalLM):
        from tokenslice.model.layers import RotaryEmbedding

        model.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                       arch.rope_scaling)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: names shard(s) that are missing: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found (pytorch .bin files are not loaded)")
    return files


def _load_weights(model: nn.Module, arch: ArchConfig, path: Path, shard: TPShard | None = None,
                  stage: PPStage | None = None) -> None:
    def tensors() -> Iterator[CheckpointTensor]:
        for file in _weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    yield CheckpointTensor(key, tuple(part.get_shape()), lambda part=part: part, str(file))

    _copy_checkpoint(model, arch, tensors(), shard, stage, f"{path}: weights missing from the safetensors files")


def _load_gguf_weights(model: nn.Module, arch: ArchConfig, reader: Any, path: Path, shard: TPShard | None,
                       stage: PPStage | None) -> dict[str, str | None]:
    """The GGUF file's weights, dequantized; returns the precision each local parameter had in the file."""
    weights = list(gguf_weights(reader, arch, path))
    loaded = _copy_checkpoint(model, arch, (CheckpointTensor(w.name, w.shape, w.read, str(path)) for w in weights),
                              shard, stage, f"{path}: weights missing from the GGUF file")
    precision = {w.name: w.precision for w in weights}
    local = {name: precision.get(source) for name, source in loaded.items()}
    if arch.tie_word_embeddings and "model.embed_tokens.weight" in local:
        local["lm_head.weight"] = local["model.embed_tokens.weight"]  # the head is the embedding
    return local


def _copy_checkpoint(model: nn.Module, arch: ArchConfig, tensors: Iterable[CheckpointTensor], shard: TPShard | None,
                     stage: PPStage | None, missing_message: str) -> dict[str, str]:
    """Copy each checkpoint tensor into its parameter (this shard's slice of it, this stage's
    layers only); returns {local parameter: checkpoint name} of those copied."""
    params = dict(model.named_parameters())
    # The checkpoint is checked against the whole model's shapes; a shard reads its part of it.
    with torch.device("meta"):
        full_shapes = {n: tuple(p.shape) for n, p in build_model(arch).named_parameters(remove_duplicate=False)}
    loaded: dict[str, str] = {}
    for tensor in tensors:
        key = tensor.name
        name = key if key in full_shapes else f"model.{key}"  # older OPT files omit "model."
        local = stage.local_name(name) if stage is not None and name in full_shapes else name
        if local is None:
            continue  # another pipeline stage's
        if local not in params:
            if not key.endswith(IGNORED_SUFFIXES):
                log.warning("%s: ignoring unexpected tensor %s", tensor.file, key)
            continue
        if tensor.shape != full_shapes[name]:
            raise ModelLoadError(f"{tensor.file}: tensor {key} has shape {tensor.shape}, "
                                 f"the config implies {full_shapes[name]}")
        part = tensor.read()
        want = tuple(params[local].shape)
        with torch.no_grad():
            params[local].copy_(part[:] if shard is None else shard.read(local, part, want))
        loaded[local] = name
    tied = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    missing = sorted(set(params) - set(loaded) - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{missing_message}: {shown}")
    return loaded
