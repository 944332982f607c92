"""Load a model from a local Hugging Face directory (config.json + *.safetensors + tokenizer),
or the built-in tiny model. Every failure names the file and the problem."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tokenslice.config import ModelConfig
from tokenslice.model.arch import ArchConfig, ModelLoadError, parse_config
from tokenslice.model.layers import onednn_packs_linears, use_input_major_linears
from tokenslice.model.builtin import BUILTIN_SEED, BUILTIN_TINY, builtin_config, builtin_tokenizer
from tokenslice.model.llama import LlamaForCausalLM
from tokenslice.model.opt import OPTForCausalLM
from tokenslice.model.pp import PPStage
from tokenslice.model.tp import TPShard, parallelize

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers and tensors some checkpoints carry that the model rebuilds itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    tokenizer: Any  # a transformers tokenizer (None if not loaded)
    dtype: torch.dtype
    device: torch.device
    name: str


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


def load_arch(cfg: ModelConfig) -> ArchConfig:
    """The checkpoint's config.json (or the built-in model's), without its weights."""
    if cfg.model == BUILTIN_TINY:
        return parse_config(builtin_config(), BUILTIN_TINY)
    path = Path(cfg.model)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (a local directory or {BUILTIN_TINY!r})")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
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
    arch = load_arch(cfg)
    shard = TPShard(arch, rank, tp_size) if tp_size > 1 else None
    distributed = shard is not None or stage is not None
    device = (rank_device(cfg.device, rank if gpu is None else gpu) if distributed
              else resolve_device(cfg.device))
    local = shard.local_arch if shard is not None else arch
    if stage is not None:
        local = stage.local_arch(local)
    dtype = resolve_dtype(cfg.dtype, arch, device)
    with torch.device("meta"):
        model = build_model(local)
        if stage is not None:
            model.keep_stage(stage.is_first, stage.is_last)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each parameter fresh storage, which unties them
    if cfg.model == BUILTIN_TINY:
        _copy_weights(model, _builtin_weights(arch), shard, stage)
    else:
        _load_weights(model, arch, Path(cfg.model), shard, stage)
    tokenizer = model_tokenizer(cfg, arch) if with_tokenizer else None
    _rebuild_buffers(model, local)
    if shard is not None:
        parallelize(model, shard, group)
    return LoadedModel(_finalize(model, device, dtype), local, tokenizer, dtype, device, str(Path(cfg.model)))


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


def _finalize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if hasattr(model, "fuse"):
        model.fuse()
    if device.type == "cpu":
        # A head tied to the embedding stays as is: transposing it would duplicate the table.
        head = model.lm_head
        tied = {id(head.weight)} if model.arch.tie_word_embeddings and head is not None else set()
        use_input_major_linears(model, tied, onednn_packs_linears(dtype))
    return model


def model_tokenizer(cfg: ModelConfig, arch: ArchConfig) -> Any:
    """The model's tokenizer (--tokenizer, else the model directory's), checked against its vocabulary."""
    source = cfg.tokenizer or str(Path(cfg.model))
    tokenizer = load_tokenizer(source)
    if cfg.model != BUILTIN_TINY:
        check_vocab(tokenizer, arch, source, str(Path(cfg.model)))
    return tokenizer


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if path == BUILTIN_TINY:
        return builtin_tokenizer()
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
    params = dict(model.named_parameters())
    # The checkpoint is checked against the whole model's shapes; a shard reads its part of it.
    with torch.device("meta"):
        full_shapes = {n: tuple(p.shape) for n, p in build_model(arch).named_parameters(remove_duplicate=False)}
    loaded: set[str] = set()
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key if key in full_shapes else f"model.{key}"  # older OPT files omit "model."
                local = stage.local_name(name) if stage is not None and name in full_shapes else name
                if local is None:
                    continue  # another pipeline stage's
                if local not in params:
                    if not key.endswith(IGNORED_SUFFIXES):
                        log.warning("%s: ignoring unexpected tensor %s", file, key)
                    continue
                part = f.get_slice(key)
                if tuple(part.get_shape()) != full_shapes[name]:
                    raise ModelLoadError(f"{file}: tensor {key} has shape {tuple(part.get_shape())}, "
                                         f"the config implies {full_shapes[name]}")
                want = tuple(params[local].shape)
                tensor = part[:] if shard is None else shard.read(local, part, want)
                with torch.no_grad():
                    params[local].copy_(tensor)
                loaded.add(local)
    tied = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {shown}")
