"""`builtin:tiny`: a small Llama with deterministic random weights and a byte-level tokenizer
built here, so the server and demos run on a machine with no model files. Its text is noise."""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenslice.model.known_models import BUILTIN_TINY  # re-exported: the name lives with the other known names

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BUILTIN_SEED = 1234

# A plain role-tagged template, so chat requests work on the built-in model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def builtin_config() -> dict[str, Any]:
    vocab = 256 + len(SPECIAL_TOKENS)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 256, "eos_token_id": 257, "hidden_act": "silu",
    }


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level: every byte is one token (ids 0..255), then <s>, </s>, <pad>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _byte_level_chars(), strict=True)}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE,
                                   model_max_length=builtin_config()["max_position_embeddings"])


def _byte_level_chars() -> list[str]:
    """The printable stand-in for each byte used by byte-level BPE (GPT-2's mapping)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]
