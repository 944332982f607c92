"""The engine's logprobs (request.TokenLogprobs) in OpenAI's wire shapes: the completions
{tokens, token_logprobs, top_logprobs, text_offset}, chat's content[] entries, and vLLM's
prompt_logprobs extension.

A token's text is read in context: decode([previous, token]) minus decode([previous]), so a
SentencePiece token keeps the leading space a lone decode would strip (as vLLM's detokenizer).
"""
from __future__ import annotations

from typing import Any

from tokenslice.request import TokenLogprobs
from tokenslice.server.responses import ChatLogprob, ChatLogprobs, ChatTopLogprob, CompletionLogprobs, PromptLogprob

# JSON has no -inf; vLLM clamps to this as well.
MIN_LOGPROB = -9999.0


def _finite(lp: float) -> float:
    return max(lp, MIN_LOGPROB)


class TokenTexts:
    """Token texts of one response (a small cache: the same context token recurs for every
    alternative of a position). Without a tokenizer a token reads "token_id:<id>", as vLLM's
    return_tokens_as_token_ids."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._alone: dict[int, str] = {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _alone_text(self, token: int) -> str:
        text = self._alone.get(token)
        if text is None:
            text = self._alone[token] = self._decode([token])
        return text

    def text(self, prev: int | None, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        if prev is None:
            return self._alone_text(token)
        base = self._alone_text(prev)
        both = self._decode([prev, token])
        return both[len(base):] if both.startswith(base) else self._alone_text(token)


def completion_logprobs(texts: TokenTexts, prev: int | None, lps: TokenLogprobs, offset: int,
                        lead_token: int | None = None) -> CompletionLogprobs:
    """Entries for consecutive tokens; `prev` precedes the first one (None: none does), `offset`
    is the first token's character position in the choice text. `lead_token` comes first with no
    logprob (an echoed prompt's first token). Each top_logprobs dict lists the token itself too, as
    vLLM's does."""
    out = CompletionLogprobs()
    if lead_token is not None:
        first = texts.text(prev, lead_token)
        out.tokens.append(first)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(first)
        prev = lead_token
    for i, token in enumerate(lps.token_ids):
        text = texts.text(prev, token)
        top = {texts.text(prev, t): _finite(v) for t, v in zip(lps.top_token_ids[i], lps.top_logprobs[i], strict=True)}
        top.setdefault(text, _finite(lps.logprobs[i]))
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lps.logprobs[i]))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
        prev = token
    return out


def echo_completion_logprobs(texts: TokenTexts, prompt: list[int], prompt_lps: TokenLogprobs,
                             generated: TokenLogprobs, generated_offset: int) -> CompletionLogprobs:
    """An echoed prompt's entries (its first token with null) followed by the generated tokens',
    whose offsets start at `generated_offset` (the echoed text's length)."""
    out = completion_logprobs(texts, None, prompt_lps, 0, lead_token=prompt[0])
    gen = completion_logprobs(texts, prompt[-1], generated, generated_offset)
    out.tokens += gen.tokens
    out.token_logprobs += gen.token_logprobs
    out.top_logprobs += gen.top_logprobs
    out.text_offset += gen.text_offset
    return out


def chat_logprobs(texts: TokenTexts, prev: int | None, lps: TokenLogprobs) -> ChatLogprobs:
    """OpenAI's chat content[]: each token with exactly top_logprobs alternatives."""
    content = []
    for i, token in enumerate(lps.token_ids):
        top = [_chat_entry(ChatTopLogprob, texts.text(prev, t), v)
               for t, v in zip(lps.top_token_ids[i], lps.top_logprobs[i], strict=True)]
        entry = _chat_entry(ChatLogprob, texts.text(prev, token), lps.logprobs[i])
        entry.top_logprobs = top
        content.append(entry)
        prev = token
    return ChatLogprobs(content=content)


def _chat_entry(cls: type[ChatTopLogprob], text: str, lp: float) -> Any:
    return cls(token=text, logprob=_finite(lp), bytes=list(text.encode("utf-8")))


def prompt_logprob_entries(texts: TokenTexts, prompt: list[int], lps: TokenLogprobs
                           ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then per position the token's
    entry and its alternatives', keyed by token id."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for i, token in enumerate(lps.token_ids):
        prev = prompt[i]
        entry = {str(t): PromptLogprob(logprob=_finite(v), rank=r + 1, decoded_token=texts.text(prev, t))
                 for r, (t, v) in enumerate(zip(lps.top_token_ids[i], lps.top_logprobs[i], strict=True))}
        entry.setdefault(str(token), PromptLogprob(logprob=_finite(lps.logprobs[i]), rank=lps.ranks[i],
                                                   decoded_token=texts.text(prev, token)))
        out.append(entry)
    return out
