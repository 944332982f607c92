"""Output-length prediction as the engine uses it (ALISE §3.1): predict at arrival, learn the real
length at finish, so the predictor keeps up with the traffic it serves.

A predictor directory (`--length-predictor DIR`) holds an embedding predictor (predictor.json,
predict/length.py), a self length head (self_head.npz, predict/self_head.py), or both; what it
holds decides the kind:

- embed: the prompt's sentence embedding, at arrival;
- self: the served model's own hidden state, at the end of prefill and every k generated tokens
  (until its prefill a request counts as one token, UNTIL_PREFILL, so it is prefilled first);
- both: the embedding at arrival, blended in log space with the head at the end of prefill; the
  head alone refines after that.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenslice.plan import StepPlan
from tokenslice.predict.self_head import SELF_HEAD_FILE, SelfHeadConfig, SelfLengthHead
from tokenslice.predict.self_refine import SelfRefiner
from tokenslice.request import Request

EMBED_FILE = "predictor.json"
# "self" alone: a request counts as this many output tokens until its prefill gives the head's
# prediction, so srpt-predicted runs new prefills first (as TRAIL predicts at prefill): a prefill
# is short next to an answer, its KV is kept, and one step later the request has its real rank.
UNTIL_PREFILL = 1
LENGTH_PREDICTOR_KINDS = ("embed", "self", "both")


# Self length heads that ship with the package, by known model name: fitted on the model's own
# answers (benchmarks/length/ship_head.py rebuilds them), weights only (a few KB).
SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"


def state_dir() -> Path:
    """Where the server keeps what it learns across restarts: $XDG_STATE_HOME/tokenslice
    (~/.local/state/tokenslice)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tokenslice"


def auto_predictor_dir(model_name: str, hidden_size: int, num_layers: int) -> Path:
    """srpt-predicted with `--length-predictor auto` (the default): the served model's self length
    head in the state directory (owner-only), kept across restarts. Created from the package's head
    for a known model, else empty: it learns from the answers the server finishes and predicts
    once it has seen min_answers of them (until then srpt-predicted ranks like skip-join-mlfq)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_name).name)[:64] or "model"
    digest = hashlib.sha1(model_name.encode()).hexdigest()[:8]  # two paths with one file name differ
    path = state_dir() / "length" / f"{safe}-{digest}"
    head_file = path / SELF_HEAD_FILE
    if head_file.is_file():
        return path
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    shipped = SHIPPED_HEADS / f"{model_name.lower()}.npz"
    if shipped.is_file():
        head = SelfLengthHead.load(shipped)
    else:  # the middle layer: what the served chat model's own lengths chose (benchmarks/length/)
        head = SelfLengthHead(SelfHeadConfig(layer=num_layers // 2, hidden_size=hidden_size))
    head.save(head_file)
    return path


def predictor_kind(path: str | Path) -> str:
    """What the directory holds: embed, self or both."""
    path = Path(path)
    embed, own = (path / EMBED_FILE).is_file(), (path / SELF_HEAD_FILE).is_file()
    if not (embed or own):
        raise FileNotFoundError(f"no length predictor in {path} (neither {EMBED_FILE} nor {SELF_HEAD_FILE}); "
                                "build one with `tokenslice predictor build` or `predictor build-self`")
    return "both" if embed and own else "embed" if embed else "self"


class OnlineLengthPredictor:
    """The engine's length predictors with the live requests' prompt texts (embed) and captured
    states (self)."""

    def __init__(self, predictor: Any, tokenizer: Any, refiner: SelfRefiner | None = None,
                 record: str | Path | None = None) -> None:
        """`record`: a JSON lines file each refined prediction is appended to (predict/recorded.py)."""
        self.predictor = predictor  # predict.length.LengthPredictor, or None (self only)
        self.tokenizer = tokenizer
        self.refiner = refiner
        self._prompt_text: dict[str, str] = {}
        self._record = open(record, "a") if record is not None else None  # noqa: SIM115 (closed in close())

    @classmethod
    def load(cls, path: str, tokenizer: Any, *, store_text: bool, hidden_size: int | None = None,
             num_layers: int | None = None, record: str | Path | None = None) -> OnlineLengthPredictor:
        """The predictors in `path`; a self head must fit the served model (`hidden_size`, `num_layers`)."""
        kind = predictor_kind(path)
        refiner = None
        if kind != "embed":
            head_file = Path(path) / SELF_HEAD_FILE
            head = SelfLengthHead.load(head_file)
            cfg = head.config
            if (hidden_size is not None and cfg.hidden_size != hidden_size) or (
                    num_layers is not None and not 0 <= cfg.layer < num_layers):
                raise ValueError(f"{head_file} reads layer {cfg.layer} of a {cfg.hidden_size}-wide model; the served "
                                 f"model has {num_layers} layers of width {hidden_size}")
            refiner = SelfRefiner(head, head_file)
        predictor = None
        if kind != "self":
            from tokenslice.predict.length import LengthPredictor  # torch and faiss: only when asked for

            predictor = LengthPredictor.load(path, store_text=store_text)
        return cls(predictor, tokenizer, refiner, record)

    @property
    def ready(self) -> bool:
        """Whether its predictions are used: a self head that is still learning is not."""
        return self.refiner is None or self.refiner.head.ready

    def describe(self) -> dict[str, Any]:
        """For /v1/state: what predicts, whether its predictions are used, how much it has learned."""
        out: dict[str, Any] = {"kind": self.kind, "ready": self.ready}
        if self.refiner is not None:
            out["answers"] = self.refiner.head.answers
            out["min_answers"] = self.refiner.head.config.min_answers
        return out

    @property
    def kind(self) -> str:
        return "both" if self.predictor and self.refiner else "self" if self.refiner else "embed"

    def predict(self, req: Request, text: str | None) -> None:
        """Set the request's predicted output length, unless it came with one; `text`: its prompt
        when the caller has it (spares a detokenization)."""
        if self.refiner is not None:
            self.refiner.add(req.request_id, req.num_prompt_tokens)
        if self.predictor is None:
            if req.predicted_output_tokens is None and self.refiner is not None and self.refiner.head.ready:
                req.predicted_output_tokens = UNTIL_PREFILL
            return
        if text is None:
            text = self.tokenizer.decode(req.prompt_token_ids)
        self._prompt_text[req.request_id] = text
        if req.predicted_output_tokens is None:
            req.predicted_output_tokens = max(1, round(self.predictor.predict_one(text)))

    def mark(self, plan: StepPlan) -> None:
        """Before the step runs: ask it for the hidden states of the requests due a prediction."""
        if self.refiner is not None and not plan.is_empty:
            self.refiner.mark(plan)

    def refine(self, hidden: Mapping[str, list[float]], plan: StepPlan, requests: Mapping[str, Request]
               ) -> dict[str, int]:
        """After the step: request id -> its new predicted total output tokens, from the states
        `plan` captured (counted before the step's token, as when it was marked)."""
        if self.refiner is None or not hidden:
            return {}
        before = {s.request_id: s.num_output_tokens for s in plan.slices if s.capture_hidden}
        remaining = self.refiner.apply(hidden, before)
        out = {}
        for rid, rem in remaining.items():
            req = requests.get(rid)
            if req is None:
                continue
            done = before[rid]
            total = done + rem
            arrival = req.predicted_output_tokens
            if done == 0 and self.predictor is not None and arrival is not None:
                w = self.refiner.head.config.blend_weight
                total = math.expm1(w * math.log1p(total) + (1 - w) * math.log1p(arrival))
            out[rid] = max(done + 1, min(round(total), req.params.max_tokens))  # never past what it may produce
            if self._record is not None:
                line = {"id": rid, "output_tokens": done, "predicted_output_tokens": out[rid]}
                self._record.write(json.dumps(line) + "\n")
        if self._record is not None and out:
            self._record.flush()
        return out

    def predicted_at(self, request_id: str) -> int | None:
        """Output tokens when the self head last predicted this request (None: it has not)."""
        return self.refiner.predicted_at(request_id) if self.refiner is not None else None

    def observe(self, finished: list[Request]) -> None:
        """Learn the lengths of finished requests; aborted ones say nothing about their length."""
        for req in finished:
            learn = req.finish_reason in ("stop", "length")
            if self.refiner is not None:
                self.refiner.finish(req.request_id, req.num_output_tokens, learn)
            text = self._prompt_text.pop(req.request_id, None)
            if text is not None and learn:
                # Cut off by max_tokens: only a lower bound on the length it wanted (censored).
                self.predictor.observe(text, req.num_output_tokens, censored=req.finish_reason == "length")

    def close(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None
        if self.refiner is not None:
            self.refiner.close()
        if self.predictor is not None:
            self.predictor.close()

