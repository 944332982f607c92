"""Incremental detokenization with stop strings.

Each step decodes a short window (a few tokens of context plus the new ones) and keeps the
difference, as vLLM does: decoding tokens one by one would lose the leading spaces that
SentencePiece-style tokenizers strip at the start of a decode. The window starts in the
prompt, so the first output token keeps its space too.

With a Rust tokenizer the window is decoded in Rust, token by token (tokenizers' DecodeStream,
the same prefix-window rule as above, as vLLM's fast detokenizer): one call per token instead of
two decodes. The Python window remains for other tokenizers, and for the bytes an answer's last
token leaves incomplete.

Text is released only when it can no longer change: a multi-byte character still being
spelled out, or a possible prefix of a stop string, is held back until it resolves. So the
concatenated stream equals the final text.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tokenslice.request import RequestOutput, SamplingParams

CONTEXT_TOKENS = 5


def _rust_tokenizer(tokenizer: Any, options: dict[str, bool]) -> Any | None:
    """The Rust tokenizer behind `tokenizer` when its Python wrapper would return the Rust decode
    unchanged for these options (the wrapper's argument checks cost several times the decode
    itself, for every token of every stream); None otherwise."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another tokenizer library: its own decode
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is TokenizersBackend.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces
            and set(options) == {"skip_special_tokens"}):
        return tokenizer.backend_tokenizer
    return None


def _decoder(tokenizer: Any, options: dict[str, bool]) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, **options)`, straight from the Rust tokenizer where that is the same."""
    backend = _rust_tokenizer(tokenizer, options)
    if backend is not None:
        skip = options["skip_special_tokens"]
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode(ids, **options)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 include_stop_str: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        # Only what differs from the tokenizer's defaults, so tokenizers without the option work.
        self._decode_options: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self._decode_options["spaces_between_special_tokens"] = False
        self._decode = _decoder(tokenizer, self._decode_options)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._backend = _rust_tokenizer(tokenizer, self._decode_options)
        self._stream: Any = None
        # A prompt that ends inside a character: the stream would release its bytes as the answer's.
        if self._backend is not None and not self._decode(self._ids).endswith("\ufffd"):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=self._ids, skip_special_tokens=skip_special_tokens)
        self.text = ""  # decoded output so far (cut before a stop string once found)
        self._emitted = 0
        self.stopped = False

    @classmethod
    def for_request(cls, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request's output, as its sampling parameters ask."""
        return cls(tokenizer, prompt_token_ids, params.stop, skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   include_stop_str=params.include_stop_str_in_output)

    def add_step(self, token_ids: list[int], finish_reason: str | None) -> None:
        """A step's new tokens. One that finished the request with "stop" (EOS, stop_token_ids;
        a stop string is found in the text instead) stays out of the text unless
        include_stop_str, as vLLM does."""
        self.add([] if finish_reason == "stop" and not self.include_stop_str else token_ids)

    def add(self, token_ids: list[int], final: bool = False) -> None:
        """Decode new tokens; sets `stopped` if a stop string appeared (text is cut before it).
        `final`: no more tokens will come, so bytes of an incomplete character are released too."""
        if self.stopped:
            return
        before = len(self.text)
        if self._stream is None:
            self._ids.extend(token_ids)
            self._add_window(final)
        else:
            for i, tok in enumerate(token_ids):
                self._ids.append(tok)
                try:
                    chunk = self._stream.step(self._backend, tok)
                except Exception:  # tokenizers refuses some byte-fallback sequences: the window goes on
                    self._stream = None
                    self._ids.extend(token_ids[i + 1:])
                    self._add_window(final)
                    break
                if chunk is not None:
                    self.text += chunk
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            else:
                if final and self._read_offset < len(self._ids):  # bytes of a character never completed
                    self._add_window(final)
        if len(self.text) == before or not self.stop:
            return
        # A stop string may straddle old and new text; the earliest match wins.
        hits = [(at, at + len(s)) for s in self.stop if (at := self.text.find(s, max(0, before - len(s) + 1))) != -1]
        if hits:
            start, end = min(hits)
            self.text = self.text[:end if self.include_stop_str else start]
            self.stopped = True

    def _add_window(self, final: bool) -> None:
        """The text of the tokens since the last release, as the difference of two decodes."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return  # nothing printable yet, or an incomplete UTF-8 sequence: wait for more
        self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def delta(self, final: bool) -> str:
        """New text that is safe to send; all of it when `final`."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def apply(self, out: RequestOutput) -> bool:
        """Fill a step output's text on the API server's side of the engine. On a stop string the
        output becomes the request's last ("stop"), and True says the engine must be told to
        abort it: the engine has already moved on to the next step, whose token is never sent."""
        if not out.finished:
            self.add(out.new_token_ids)
        else:
            self.add_step(out.new_token_ids, out.finish_reason)
            self.add([], final=True)  # release bytes held back waiting for a character to complete
        ended_here = self.stopped and not out.finished
        if ended_here:
            out.finished, out.finish_reason = True, "stop"
            if out.metrics is not None and out.metrics.token_times:  # a copy: the engine may own it
                out.metrics = dataclasses.replace(out.metrics, finish_time=out.metrics.token_times[-1])
        out.text_delta = self.delta(out.finished)
        return ended_here
