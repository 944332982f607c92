"""Incremental detokenization in Rust (tokenizers' DecodeStream) against the two-decode window it
replaces, on real tokenizers (byte-level BPE, a SentencePiece-style Llama tokenizer with byte
fallback, Qwen3's, and builtin:tiny's random bytes): the streamed text is the answer's text in
its context, stop strings cut it where they did, and on random ids of a byte-level tokenizer
its text is the whole decode's."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import STORIES
from tokenslice.engine.detokenizer import IncrementalDetokenizer
from tokenslice.model.builtin import BUILTIN_TINY
from tokenslice.model.loader import load_tokenizer

TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
TEXTS = [("Once upon a", " time, there was a café near the sea."), ("Tokyo:", " 東京は大きい都市です。"),
         ("A", " naïve — «quoted» 😀!\nNext line.")]


@pytest.fixture(scope="module", params=["gpt2", "qwen3", "stories260k", BUILTIN_TINY])
def tokenizer(request):
    name = request.param
    path = str(STORIES) if name == "stories260k" else name if name == BUILTIN_TINY else str(TOKENIZERS / name)
    return load_tokenizer(path)


def _run(tokenizer, prompt: list[int], answer: list[int], stream: bool, stop: list[str]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    if not stream:
        detok._stream = None
    deltas = []
    for i, tok in enumerate(answer):
        final = i == len(answer) - 1
        detok.add([tok], final=final)
        deltas.append(detok.delta(final or detok.stopped))
        if detok.stopped:
            break
    return deltas


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_stream_is_the_answer_in_its_context(tokenizer):
    # GPT-2's files ask for clean_up_tokenization_spaces: its Python decode is kept.
    assert (IncrementalDetokenizer(tokenizer, [1], [])._stream is None) == bool(tokenizer.clean_up_tokenization_spaces)
    for prompt_text, answer_text in TEXTS:
        prompt, answer = _ids(tokenizer, prompt_text), _ids(tokenizer, answer_text)
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        whole = tokenizer.decode(prompt + answer, skip_special_tokens=True)
        assert whole.startswith(before)
        for stream in (True, False):
            assert "".join(_run(tokenizer, prompt, answer, stream, [])) == whole[len(before):], stream


def test_stop_strings_cut_the_same_text(tokenizer):
    for prompt_text, answer_text in TEXTS:
        prompt, answer = _ids(tokenizer, prompt_text), _ids(tokenizer, answer_text)
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        text = tokenizer.decode(prompt + answer, skip_special_tokens=True)[len(before):]
        stop = [text[6:9]]
        streamed = _run(tokenizer, prompt, answer, True, stop)
        assert streamed == _run(tokenizer, prompt, answer, False, stop)
        assert "".join(streamed) == text[:text.index(stop[0])]


def test_random_bytes_stream_as_the_whole_decode():
    # Byte-level: random ids split characters anywhere and leave invalid sequences, which the
    # stream releases as the whole decode does (the window lost text next to replacement chars).
    tokenizer = load_tokenizer(BUILTIN_TINY)
    rng = random.Random(1)
    prompt = _ids(tokenizer, "abcd")
    for _ in range(20):
        answer = [rng.randrange(len(tokenizer)) for _ in range(40)]
        whole = tokenizer.decode(prompt + answer, skip_special_tokens=True)
        assert "".join(_run(tokenizer, prompt, answer, True, [])) == whole[len("abcd"):]


def test_a_sequence_the_stream_refuses_goes_on_in_the_window():
    # Random ids of a byte-fallback SentencePiece tokenizer: tokenizers' stream raises on some
    # ("invalid prefix"); the request's text goes on from the Python window, nothing lost or repeated.
    tokenizer = load_tokenizer(str(STORIES))
    prompt = [505, 341, 249, 333]
    answer = [64, 195, 227, 244, 145, 458, 93, 82, 327, 501, 111, 308, 298, 127, 340, 208, 294, 455, 93, 394]
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    deltas = []
    for i, tok in enumerate(answer):
        detok.add([tok], final=i == len(answer) - 1)
        deltas.append(detok.delta(i == len(answer) - 1))
    assert detok._stream is None and "".join(deltas) == detok.text and detok.text


def test_a_prompt_ending_inside_a_character_keeps_its_bytes():
    # The prompt's last token starts a 3-byte character the answer never completes: none of the
    # prompt's bytes may come out as the answer's text (the stream would release them).
    tokenizer = load_tokenizer(BUILTIN_TINY)
    euro = _ids(tokenizer, "€")  # three byte tokens
    prompt, answer = _ids(tokenizer, "price ") + euro[:1], _ids(tokenizer, "x and y")
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    assert detok._stream is None
    for i, tok in enumerate(answer):
        detok.add([tok], final=i == len(answer) - 1)
    assert detok.text == "x and y"
