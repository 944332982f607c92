"""Seeding and scoring the self length head (predict/self_head.py) from recorded hidden states.

A features file (.npz, written by benchmarks/length/self_features.py) holds one row per (answer,
t): `layer{L}` the state after layer L at "t tokens generated", and beside it `id`, `t`,
`output_tokens`, `prompt_tokens`, `split` (train | test), `source` (alpaca | sharegpt) and
`finish_reason`. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.predict.blend import spearman
from tokenslice.predict.self_head import SelfHeadConfig, SelfLengthHead


@dataclass
class StateRows:
    """Rows of one layer's states and what each row is."""

    hidden: np.ndarray  # [n, dim]
    prompt_hidden: np.ndarray  # [n, dim]: the state at t = 0 of the row's answer (its prompt's last token)
    ids: np.ndarray
    t: np.ndarray  # generated tokens at the row
    output_tokens: np.ndarray  # the answer's final length
    prompt_tokens: np.ndarray
    split: np.ndarray
    source: np.ndarray

    def __len__(self) -> int:
        return len(self.t)

    @property
    def remaining(self) -> np.ndarray:
        return self.output_tokens - self.t

    def where(self, mask: np.ndarray) -> StateRows:
        return StateRows(*(getattr(self, f)[mask] for f in self.__dataclass_fields__))


def load_rows(path: str | Path, layer: int) -> StateRows:
    with np.load(path, allow_pickle=False) as d:
        key = f"layer{layer}"
        if key not in d:
            have = sorted(k for k in d if k.startswith("layer"))
            raise ValueError(f"{path} has no states of layer {layer} (it has {have})")
        hidden, ids, t = d[key].astype(np.float32), d["id"], d["t"]
        at_prompt = {rid: i for i, (rid, tt) in enumerate(zip(ids.tolist(), t.tolist(), strict=True)) if tt == 0}
        missing = set(ids.tolist()) - at_prompt.keys()
        if missing:
            raise ValueError(f"{path}: {len(missing)} answers have no row at t = 0 (their prompt's state)")
        prompt_hidden = hidden[[at_prompt[rid] for rid in ids.tolist()]]
        return StateRows(hidden, prompt_hidden, ids, t, d["output_tokens"], d["prompt_tokens"], d["split"],
                         d["source"])


def fit_head(rows: StateRows, config: SelfHeadConfig) -> SelfLengthHead:
    """A head fitted on `rows` (those with t <= config.max_t)."""
    if config.max_t is not None:
        rows = rows.where(rows.t <= config.max_t)
    head = SelfLengthHead(config)
    for start in range(0, len(rows), 4096):  # the sums in chunks: bounded memory
        part = slice(start, start + 4096)
        head.add(rows.hidden[part], rows.prompt_tokens[part], rows.t[part], rows.remaining[part],
                 rows.prompt_hidden[part])
    if not head.fit():
        raise ValueError("too few rows to fit a self length head")
    head.answers = len(np.unique(rows.ids))
    return head


def predict_log(head: SelfLengthHead, rows: StateRows) -> np.ndarray:
    """The head's log(1 + remaining) for every row."""
    return head.predict_log(rows.hidden, rows.prompt_tokens, rows.t, rows.prompt_hidden)


def spearman_at(head: SelfLengthHead, rows: StateRows, t: int) -> dict[str, Any]:
    """Spearman of predicted vs true remaining length over the rows at exactly `t` generated
    tokens (answers longer than t), overall and per source."""
    at = rows.where(rows.t == t)
    out: dict[str, Any] = {}
    if not len(at):
        return out
    pred = predict_log(head, at)
    out["all"] = {"n": len(at), "spearman": spearman(pred, at.remaining)}
    for src in sorted(set(at.source.tolist())):
        m = at.source == src
        out[src] = {"n": int(m.sum()), "spearman": spearman(pred[m], at.remaining[m])}
    return out


def stale_spearman(head: SelfLengthHead, rows: StateRows, t: int, lag: int) -> float | None:
    """Spearman at t of a prediction made `lag` tokens earlier (its remaining minus lag): what a
    refinement every k tokens ranks by, between refinements."""
    now = rows.where(rows.t == t)
    then = rows.where(rows.t == t - lag)
    index = {rid: i for i, rid in enumerate(then.ids.tolist())}
    keep = [i for i, rid in enumerate(now.ids.tolist()) if rid in index]
    if len(keep) < 3:
        return None
    prev = [index[now.ids[i]] for i in keep]
    pred = head.predict_remaining(then.hidden[prev], then.prompt_tokens[prev], then.t[prev],
                                  then.prompt_hidden[prev]) - lag
    return spearman(pred, now.remaining[keep])


__all__ = ["StateRows", "load_rows", "fit_head", "predict_log", "spearman_at", "stale_spearman"]
