"""The choices of one API request: each (prompt, sample) pair is its own engine request, so the
scheduler ranks, preempts and finishes every choice on its own; they are aborted together.

`Choice` accumulates one engine request's outputs; `merged` interleaves several streams in the
order outputs arrive; `abort_unfinished` aborts the choices still running; `best_of` keeps the
n candidates of each prompt with the highest cumulative logprob (OpenAI's best_of);
`sibling_seed` gives every sample of a seeded request its own reproducible stream;
`finish_reason` says why a choice ended, in OpenAI's words, and `StopReasons` which stop string or
token ended it (vLLM's stop_reason).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenslice.engine.protocol import EngineClient, RequestStream
from tokenslice.request import RequestOutput, TokenLogprobs

_SEED_SPAN = 2**64  # torch generators take a 64-bit seed
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive siblings get well-spread seeds


def sibling_seed(seed: int | None, i: int) -> int | None:
    """Seed of sample `i` of a request seeded with `seed`: sample 0 keeps it (n=1 is unchanged),
    the others get distinct seeds derived from it, the same whatever else runs."""
    if seed is None or i == 0:
        return seed
    return (seed + i * _GOLDEN) % _SEED_SPAN


@dataclass
class Choice:
    """One engine request's output so far."""

    prompt_index: int
    prompt_token_ids: list[int]
    stream: RequestStream
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    prompt_logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    num_output_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        if out.logprobs is not None:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = out.cumulative_logprob
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice number, output) for every output of every choice, as they arrive; ends when all
    have finished, or raises the first stream's error."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((k, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((k, e))
            return
        queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, c.stream)) for k, c in enumerate(choices)]
    try:
        left = len(tasks)
        while left:
            k, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


def abort_unfinished(engine: EngineClient, choices: list[Choice]) -> None:
    for c in choices:
        if not c.stream.finished:
            engine.abort(c.stream)


def best_of(choices: list[Choice], n: int) -> list[Choice]:
    """Per prompt (in prompt order), the n candidates with the highest cumulative logprob."""
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(c.prompt_index, []).append(c)
    out: list[Choice] = []
    for idx in sorted(by_prompt):
        out += sorted(by_prompt[idx], key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    return out


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason for the engine's. The engine says "abort" only for requests whose
    client already left."""
    return reason if reason in ("stop", "length") else ("length" if reason else None)


def output_finish_reason(out: RequestOutput) -> str | None:
    """finish_reason of a stream chunk: set on the output that finishes the choice."""
    return finish_reason(out.finish_reason) if out.finished else None


# Prompt tokens decoded before the output when reading its text, so a first token keeps its
# leading space (as the engine's detokenizer reads it, engine/detokenizer.py).
CONTEXT_TOKENS = 5


@dataclass
class StopReasons:
    """vLLM's stop_reason of a choice that finished with "stop": the stop token id (stop_token_ids,
    or another end token of the model) or the stop string that ended it; None after the model's
    end-of-sequence token, a length limit or an abort. The engine reports only "stop", so the
    string is found again in the output's text, the earliest match first as the detokenizer does."""

    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    skip_special_tokens: bool
    tokenizer: Any

    @classmethod
    def for_request(cls, body: Any, tokenizer: Any) -> StopReasons:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        return cls(stop, list(body.stop_token_ids), body.ignore_eos, body.skip_special_tokens, tokenizer)

    def of(self, c: Choice) -> int | str | None:
        if c.finish_reason != "stop" or not c.token_ids:
            return None
        last = c.token_ids[-1]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if last == eos and not self.ignore_eos:
            return None
        if last in self.stop_token_ids:
            return last
        if self.stop and self.tokenizer is not None:
            hit = self._stop_string(c)
            if hit is not None:
                return hit
        # Else one of the model's other end tokens (the engine adds them to the stop tokens, as vLLM).
        return last if last in (getattr(self.tokenizer, "all_special_ids", None) or ()) else None

    def _stop_string(self, c: Choice) -> str | None:
        context = c.prompt_token_ids[-CONTEXT_TOKENS:]
        decode = self.tokenizer.decode
        base = decode(context, skip_special_tokens=self.skip_special_tokens)
        full = decode(context + c.token_ids, skip_special_tokens=self.skip_special_tokens)
        text = full[len(base):] if full.startswith(base) else decode(c.token_ids,
                                                                     skip_special_tokens=self.skip_special_tokens)
        hits = [(at, len(s), s) for s in self.stop if (at := text.find(s)) != -1]
        return min(hits)[2] if hits else None
