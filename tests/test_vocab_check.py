"""Start-up check: every id the tokenizer can produce must have a row in the model's embedding."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import GPT2_TOKENIZER, STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.model.arch import ModelLoadError


def _llama(out: Path, vocab_size: int) -> Path:
    """A tiny random Llama with `vocab_size` embedding rows and stories260k's 512-token tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2)).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    return out


def test_larger_tokenizer_is_refused_naming_both_sizes() -> None:
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(STORIES), tokenizer=str(GPT2_TOKENIZER))
    assert "50257" in str(exc.value) and "512" in str(exc.value)


def test_checkpoint_with_too_few_rows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(_llama(tmp_path / "small", 300)))
    assert "512 tokens" in str(exc.value) and "300 embedding rows" in str(exc.value)


def test_padded_model_vocab_is_fine(tmp_path: Path) -> None:
    llm = LLM(str(_llama(tmp_path / "padded", 640)))
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    llm.close()


def test_serve_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenslice.cli import main

    assert main(["serve", "--model", str(STORIES), "--tokenizer", str(GPT2_TOKENIZER), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "50257" in err and "512" in err
