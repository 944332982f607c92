"""Server-sent events of the streamed completions: one `data:` line per JSON chunk, then
`data: [DONE]`; `TextChunk` renders the token-by-token chunks cheaply."""
from __future__ import annotations

import json
from collections.abc import Callable

DONE = "data: [DONE]\n\n"
_TEXT_MARK = "tokenslice-text-mark"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class TextChunk:
    """SSE events of a stream's chunks that differ only in their text: pydantic renders the chunk
    once, and each token's text is spliced into that JSON (one string escape per token instead of
    building and dumping models; the JSON means the same)."""

    def __init__(self, render: Callable[[str], str]) -> None:
        self.render = render
        page, mark = render(_TEXT_MARK), json.dumps(_TEXT_MARK)
        head, _, tail = page.partition(mark)
        self.parts = (head, tail) if page.count(mark) == 1 else None

    def __call__(self, text: str) -> str:
        if self.parts is None:
            return sse(self.render(text))
        return f"data: {self.parts[0]}{json.dumps(text, ensure_ascii=False)}{self.parts[1]}\n\n"
