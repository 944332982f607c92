"""Output-length prediction as the engine uses it (ALISE §3.1): predict at arrival, learn the real
length at finish, so the predictor keeps up with the traffic it serves."""
from __future__ import annotations

from typing import Any

from tokenslice.request import Request


class OnlineLengthPredictor:
    """Wraps a predict.length.LengthPredictor with the prompt texts of the live requests."""

    def __init__(self, predictor: Any, tokenizer: Any) -> None:
        self.predictor = predictor
        self.tokenizer = tokenizer
        self._prompt_text: dict[str, str] = {}

    @classmethod
    def load(cls, path: str, tokenizer: Any, *, store_text: bool) -> OnlineLengthPredictor:
        from tokenslice.predict.length import LengthPredictor  # torch and faiss: only when asked for

        return cls(LengthPredictor.load(path, store_text=store_text), tokenizer)

    def predict(self, req: Request, text: str | None) -> None:
        """Set the request's predicted output length, unless it came with one; `text`: its prompt
        when the caller has it (spares a detokenization)."""
        if text is None:
            text = self.tokenizer.decode(req.prompt_token_ids)
        self._prompt_text[req.request_id] = text
        if req.predicted_output_tokens is None:
            req.predicted_output_tokens = max(1, round(self.predictor.predict_one(text)))

    def observe(self, finished: list[Request]) -> None:
        """Learn the lengths of finished requests; aborted ones say nothing about their length."""
        for req in finished:
            text = self._prompt_text.pop(req.request_id, None)
            if text is not None and req.finish_reason in ("stop", "length"):
                # Cut off by max_tokens: only a lower bound on the length it wanted (censored).
                self.predictor.observe(text, req.num_output_tokens, censored=req.finish_reason == "length")

    def close(self) -> None:
        self.predictor.close()
