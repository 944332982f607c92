"""The 24M-parameter Llama of the per-token-cost comparison (hidden 512, 8 layers, 8 heads,
4 KV heads, intermediate 1376, vocab 512), random weights (seed 0), fp32, with stories260k's
512-token tokenizer so that text prompts, detokenization and GGUF conversion all work."""
from __future__ import annotations

import shutil
from pathlib import Path

SHARED = Path(__file__).resolve().parents[3] / "shared"
STORIES = SHARED / "models" / "stories260k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_llama24m(path: Path) -> int:
    """Write the checkpoint to `path` (a directory); returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1376, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    model = LlamaForCausalLM(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(STORIES / name, path / name)
    return sum(p.numel() for p in model.parameters())
