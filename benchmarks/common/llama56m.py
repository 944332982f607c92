"""The 56M-parameter Llama that the engine-speed, logprobs, KV-transfer, parallelism and
simulator benchmarks share (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376, vocab
32000), random weights (seed 0), fp32, and its random prompts (64 prompt + 64 new tokens)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROMPT, NEW = 64, 64
# Prompts are token ids below 32000. The loader refuses a tokenizer with ids past the model's
# embedding rows (GPT-2's has 50257), so the checkpoint carries stories260k's 512-token one.
TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_checkpoint(path: Path) -> int:
    """Write the checkpoint to `path` (a directory); returns its parameter count."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1376, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, path / name)
    return sum(p.numel() for p in model.parameters())


def prompts(batch: int) -> torch.Tensor:
    """`batch` rows of PROMPT random token ids, the same for the same batch size."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, 32000, (batch, PROMPT), generator=g)
