"""Shared fixtures: paths into ../shared and tiny random checkpoints built with transformers."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260k"
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"


def build_tiny_checkpoint(kind: str, out: Path) -> Path:
    """A small random HF checkpoint of the given family, with stories260k's 512-token tokenizer."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed({"llama": 0, "qwen2": 1, "opt": 2, "qwen2-1kv": 3}[kind])
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)
    if kind == "llama":  # GQA, untied head, non-default rope theta
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=128, num_key_value_heads=2, rope_theta=500000.0,
                                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **common))
    elif kind in ("qwen2", "qwen2-1kv"):  # qkv bias, tied embeddings; GQA, or one KV head for all
        model = Qwen2ForCausalLM(Qwen2Config(intermediate_size=128, num_key_value_heads=1 if kind == "qwen2-1kv" else 2,
                                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **common))
    elif kind == "opt":
        model = OPTForCausalLM(OPTConfig(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2, **common))
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {k: build_tiny_checkpoint(k, root / k) for k in ("llama", "qwen2", "opt")}


@pytest.fixture(scope="session")
def stories_llm():
    from tokenslice import LLM

    return LLM(str(STORIES))


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What servers learn across restarts (srpt-predicted's length heads) goes to a directory of
    the test session, never the user's own (servers the tests start inherit it)."""
    path = tmp_path_factory.mktemp("state")
    os.environ["XDG_STATE_HOME"] = str(path)
    return path
