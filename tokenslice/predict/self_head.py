"""SelfLengthHead: a request's remaining output length from the served model's own hidden state
(TRAIL, arXiv 2410.01035: the serving LLM's layer embeddings predict the remaining length, and
the prediction sharpens as the answer unfolds).

Features of one row: the hidden state of the request's latest token after decoder layer `layer`
(the prompt's last token at prefill, later the token a decode step computed), beside it the prompt's
last-token state (what the request asked: on their own, the latest token's state ranks the rest
of an answer worse than the prompt's does), log(1 + prompt tokens) and log(1 + tokens generated
so far). Target: log(1 + tokens still to come). Ridge
regression on standardised features, solved in closed form from running sums (n, sum x, sum xx^T,
sum y, sum xy): an online update adds a finished request's rows to the sums, and a refit is one
solve of a (dim + 3)^2 system, so the head keeps learning the deployment's own lengths at no
training cost on the serving thread. numpy only.

A head is one file, `self_head.npz` in a length-predictor directory (see predict/online.py):
its configuration (JSON), the sums and the fitted weights; written atomically, mode 0600.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tokenslice.predict.history import PRIVATE_FILE_MODE

SELF_HEAD_FILE = "self_head.npz"
EXTRA_FEATURES = 2  # log prompt tokens, log generated tokens


@dataclass
class SelfHeadConfig:
    layer: int  # decoder layer whose output is read (0-based); chosen by measurement
    hidden_size: int  # the model's; a head only fits the model it was trained on
    ridge: float = 1.0  # L2 penalty per row on standardised features
    refine_every: int = 16  # k: generated tokens between re-predictions of a running request
    # Learn only from states captured within this many generated tokens (None: all): the early
    # states are what rankings hinge on, and long loops' many late rows would outweigh them.
    max_t: int | None = 128
    refit_every: int = 32  # finished requests between online refits
    # Seconds of predictions per engine step (ALISE budgets <= 10 ms per prediction; refinement
    # shares one budget over the batch): requests due beyond it wait for a later step.
    budget_s: float = 0.002
    # Weight of this head in log space at prefill when an embedding predictor is loaded too
    # ("both"): the rest is the embedding predictor's arrival estimate.
    blend_weight: float = 0.7
    # Rows carry the prompt's last-token state beside the latest one (False: heads saved before it).
    prompt_state: bool = True
    # Answers a head learns from before it predicts: a head that starts empty (a model with no
    # shipped head) only learns until then, and srpt-predicted ranks like skip-join-mlfq.
    min_answers: int = 64


class SelfLengthHead:
    """Remaining-length regression; `add` rows, `fit`, `predict_remaining`."""

    def __init__(self, config: SelfHeadConfig) -> None:
        self.config = config
        d = config.hidden_size * (2 if config.prompt_state else 1) + EXTRA_FEATURES
        self.n = 0.0
        self.sx = np.zeros(d)
        self.sxx = np.zeros((d, d))
        self.sy = 0.0
        self.sxy = np.zeros(d)
        self.weights: np.ndarray | None = None  # [d] on raw features
        self.bias = 0.0
        self.rows_since_fit = 0
        self.answers = 0  # finished requests whose rows it learned from
        # Weights a shipped head was fitted to offline (its sums are not shipped): refits pull
        # towards them instead of towards zero, so a deployment's few answers adjust, not replace.
        self.prior: np.ndarray | None = None

    def features(self, hidden: np.ndarray, prompt_tokens: np.ndarray, generated: np.ndarray,
                 prompt_hidden: np.ndarray | None = None) -> np.ndarray:
        """[n, d] float64 rows. `prompt_hidden`: each row's prompt state; may be left out when
        every row is at the prompt (generated 0), where it is `hidden` itself."""
        n = len(prompt_tokens)
        parts = [np.asarray(hidden, dtype=np.float64).reshape(n, -1)]
        if self.config.prompt_state:
            if prompt_hidden is None:
                if np.any(np.asarray(generated) > 0):
                    raise ValueError("rows past the prompt need the prompt's state (prompt_hidden)")
                prompt_hidden = parts[0]
            parts.append(np.asarray(prompt_hidden, dtype=np.float64).reshape(n, -1))
        parts.append(np.stack([np.log1p(np.asarray(prompt_tokens, dtype=np.float64)),
                               np.log1p(np.asarray(generated, dtype=np.float64))], axis=1))
        return np.hstack(parts)

    def add(self, hidden: np.ndarray, prompt_tokens: np.ndarray, generated: np.ndarray, remaining: np.ndarray,
            prompt_hidden: np.ndarray | None = None) -> None:
        """Rows with their true remaining lengths (tokens after `generated`); rows past max_t are skipped."""
        gen = np.asarray(generated)
        if self.config.max_t is not None:
            keep = gen <= self.config.max_t
            hidden, prompt_tokens = np.asarray(hidden)[keep], np.asarray(prompt_tokens)[keep]
            gen, remaining = gen[keep], np.asarray(remaining)[keep]
            prompt_hidden = None if prompt_hidden is None else np.asarray(prompt_hidden)[keep]
        x = self.features(hidden, prompt_tokens, gen, prompt_hidden)
        y = np.log1p(np.maximum(np.asarray(remaining, dtype=np.float64), 0.0))
        self.n += len(x)
        self.sx += x.sum(0)
        self.sxx += x.T @ x
        self.sy += float(y.sum())
        self.sxy += x.T @ y
        self.rows_since_fit += len(x)

    def fit(self) -> bool:
        """Ridge from the sums; False (weights unchanged) with fewer than two rows."""
        if self.n < 2:
            return False
        n = self.n
        mu, ybar = self.sx / n, self.sy / n
        cov = self.sxx / n - np.outer(mu, mu)
        sd = np.sqrt(np.maximum(np.diag(cov), 1e-12))
        scaled = cov / np.outer(sd, sd)
        cy = (self.sxy / n - mu * ybar) / sd
        if self.prior is not None:  # ridge around the prior (in standardised units)
            cy = cy + self.config.ridge * self.prior * sd
        w = np.linalg.solve(scaled + self.config.ridge * np.eye(len(mu)), cy) / sd
        self.weights, self.bias = w, float(ybar - mu @ w)
        self.rows_since_fit = 0
        return True

    @property
    def trained(self) -> bool:
        return self.weights is not None

    @property
    def ready(self) -> bool:
        """Fitted on at least min_answers answers: its predictions are used."""
        return self.trained and self.answers >= self.config.min_answers

    def predict_log(self, hidden: np.ndarray, prompt_tokens: np.ndarray, generated: np.ndarray,
                    prompt_hidden: np.ndarray | None = None) -> np.ndarray:
        if self.weights is None:
            raise RuntimeError("the self length head has not been fitted")
        return self.features(hidden, prompt_tokens, generated, prompt_hidden) @ self.weights + self.bias

    def predict_remaining(self, hidden: np.ndarray, prompt_tokens: np.ndarray, generated: np.ndarray,
                          prompt_hidden: np.ndarray | None = None) -> np.ndarray:
        """Predicted tokens still to come per row (>= 1)."""
        log = np.clip(self.predict_log(hidden, prompt_tokens, generated, prompt_hidden), 0.0, 20.0)
        return np.maximum(np.expm1(log), 1.0)

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path, sums: bool = True) -> None:
        """`sums=False`: the fitted weights alone, as the prior of a head that learns on (a
        shipped head: KBs instead of the (dim)^2 sums)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        arrays = {"answers": np.array(self.answers), "config": np.array(json.dumps(asdict(self.config)))}
        if sums:
            arrays |= {"n": np.array(self.n), "sx": self.sx, "sxx": self.sxx, "sy": np.array(self.sy), "sxy": self.sxy}
        if self.weights is not None:
            arrays |= {"weights": self.weights, "bias": np.array(self.bias)}
        if sums and self.prior is not None:  # without sums, the weights are the prior (load)
            arrays["prior"] = self.prior
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> SelfLengthHead:
        with np.load(path, allow_pickle=False) as data:
            config = json.loads(str(data["config"]))
            config.setdefault("prompt_state", False)  # saved before heads read the prompt's state
            head = cls(SelfHeadConfig(**config))
            # Heads saved before answers were counted were fitted offline on enough of them.
            head.answers = int(data["answers"]) if "answers" in data else head.config.min_answers
            if "sxx" in data:  # else a prior alone: the sums start empty
                head.n, head.sy = float(data["n"]), float(data["sy"])
                head.sx, head.sxx, head.sxy = data["sx"].copy(), data["sxx"].copy(), data["sxy"].copy()
            if "weights" in data:
                head.weights, head.bias = data["weights"].copy(), float(data["bias"])
            if "prior" in data:
                head.prior = data["prior"].copy()
            elif "sxx" not in data and head.weights is not None:
                head.prior = head.weights.copy()
        if not math.isfinite(head.config.budget_s) or head.config.budget_s < 0 or head.config.refine_every < 1:
            raise ValueError(f"{path}: budget_s must be finite and >= 0 and refine_every >= 1")
        return head


__all__ = ["SELF_HEAD_FILE", "SelfHeadConfig", "SelfLengthHead"]
