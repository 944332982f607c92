"""The regression fallback of the output-length predictor: a small torch MLP ensemble from a
prompt's embedding and length to its log output length (ALISE §3.1 falls back to a regression
model when retrieval finds no similar enough prompt).

Choices, all measured by cross-validation on training data (docs/benchmarks/predictor.md, "Output-length
prediction"):

- target log(1 + length) with a Huber loss: output lengths are heavy-tailed and schedulers need
  the ranking right, not the mean of the tail;
- requests cut off by max_tokens are censored: their length is only a lower bound, so they add a
  one-sided loss (penalised only when the prediction is below the bound), never a target;
- early stopping on a held-out slice of the training data, so the amount of training adapts to
  the history's size (a few hundred records overfit in a handful of epochs, thousands need more);
- an ensemble of a few members with different seeds and held-out slices, averaged: cheap at this
  size and steadier than one network.

Training draws its randomness from its own torch.Generator, never the process-wide one the
engine's sampling may use, and so can run on a background thread.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tokenslice.predict.history import PRIVATE_FILE_MODE


@dataclass
class RegressorConfig:
    hidden: int = 512
    dropout: float = 0.3
    members: int = 3
    max_epochs: int = 60
    patience: int = 5  # epochs without a better held-out loss before stopping
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    batch_size: int = 64
    val_fraction: float = 0.15
    # Unit-norm embeddings have entries of ~1/sqrt(dim); scaling them up to sqrt(dim)/4 (~5 for
    # 384 dimensions) lets the first layer learn at the rate of the length feature.
    input_scale: float | None = None
    seed: int = 0


@dataclass
class TrainingSet:
    """What the regressor learns from: one row per history record."""

    embeddings: np.ndarray  # float32 [n, dim], unit norm
    prompt_tokens: np.ndarray  # int [n]
    output_len: np.ndarray  # int [n]
    censored: np.ndarray  # bool [n]

    def __len__(self) -> int:
        return len(self.output_len)


class _MLP(torch.nn.Module):
    """Linear -> GELU -> dropout -> Linear. Dropout masks come from an explicit generator."""

    def __init__(self, in_dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(in_dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)
        self.dropout = dropout

    def init_weights(self, gen: torch.Generator) -> None:
        for fc in (self.fc1, self.fc2):
            bound = 1.0 / math.sqrt(fc.in_features)  # torch's default Linear init, seeded
            with torch.no_grad():
                fc.weight.uniform_(-bound, bound, generator=gen)
                fc.bias.uniform_(-bound, bound, generator=gen)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        if gen is not None and self.dropout > 0:
            keep = torch.rand(h.shape, generator=gen) >= self.dropout
            h = h * keep / (1.0 - self.dropout)
        return self.fc2(h).squeeze(-1)


def _loss(pred: torch.Tensor, target: torch.Tensor, censored: torch.Tensor) -> torch.Tensor:
    """Huber on exact lengths; for censored rows only the shortfall below the bound counts."""
    diff = pred - target
    diff = torch.where(censored, torch.clamp(diff, max=0.0), diff)
    return torch.nn.functional.huber_loss(diff, torch.zeros_like(diff), delta=1.0)


class LengthRegressor:
    """An ensemble of MLPs over [scaled embedding, standardised log prompt length] -> log(1 + length)."""

    def __init__(self, members: list[_MLP], input_scale: float, len_mean: float, len_std: float,
                 trained_on: int) -> None:
        self.members = members
        self.input_scale = input_scale
        self.len_mean = len_mean
        self.len_std = len_std
        self.trained_on = trained_on  # history rows it was trained on (largest row id)

    @classmethod
    def fit(cls, data: TrainingSet, config: RegressorConfig, trained_on: int = 0,
            stop: threading.Event | None = None) -> LengthRegressor:
        """Train `config.members` networks; `stop` set cuts training short (the result is then
        unfinished and should be dropped)."""
        if len(data) < 2:
            raise ValueError(f"need at least 2 records to train the regressor, got {len(data)}")
        dim = data.embeddings.shape[1]
        scale = config.input_scale if config.input_scale is not None else math.sqrt(dim) / 4
        log_len = np.log1p(data.prompt_tokens.astype(np.float64))
        len_mean, len_std = float(log_len.mean()), float(log_len.std()) or 1.0
        model = cls([], scale, len_mean, len_std, trained_on)
        x = model._features(data.embeddings, data.prompt_tokens)
        y = torch.from_numpy(np.log1p(data.output_len.astype(np.float32)))
        cens = torch.from_numpy(data.censored.astype(bool))
        for m in range(config.members):
            model.members.append(_train_member(x, y, cens, config, config.seed * 1000 + m, stop))
        return model

    def predict_log(self, embeddings: np.ndarray, prompt_tokens: np.ndarray) -> np.ndarray:
        """log(1 + predicted length) per row, the ensemble mean."""
        x = self._features(embeddings, prompt_tokens)
        with torch.inference_mode():
            out = torch.stack([m(x) for m in self.members]).mean(0)
        return out.double().numpy()

    def _features(self, embeddings: np.ndarray, prompt_tokens: np.ndarray) -> torch.Tensor:
        length = (np.log1p(np.asarray(prompt_tokens, dtype=np.float64)) - self.len_mean) / self.len_std
        x = np.hstack([np.asarray(embeddings, dtype=np.float32) * float(self.input_scale), length[:, None]])
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file, fsync, rename): a crash leaves the old or the new file."""
        path = Path(path)
        tensors = {f"m{i}.{k}": v.detach().contiguous() for i, m in enumerate(self.members)
                   for k, v in m.state_dict().items()}
        first = self.members[0]
        meta = {"members": str(len(self.members)), "hidden": str(first.fc1.out_features),
                "in_dim": str(first.fc1.in_features), "dropout": repr(first.dropout),
                "input_scale": repr(self.input_scale), "len_mean": repr(self.len_mean),
                "len_std": repr(self.len_std), "trained_on": str(self.trained_on)}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, PRIVATE_FILE_MODE)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> LengthRegressor:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        members = []
        for i in range(int(meta["members"])):
            m = _MLP(int(meta["in_dim"]), int(meta["hidden"]), float(meta["dropout"]))
            m.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"m{i}.")})
            members.append(m.eval())
        return cls(members, float(meta["input_scale"]), float(meta["len_mean"]), float(meta["len_std"]),
                   int(meta["trained_on"]))


def _train_member(x: torch.Tensor, y: torch.Tensor, cens: torch.Tensor, cfg: RegressorConfig, seed: int,
                  stop: threading.Event | None = None) -> _MLP:
    """One network: Adam(W) on a random (1 - val_fraction) of the rows, keeping the weights with the
    best held-out loss, stopping after `patience` epochs without improvement."""
    gen = torch.Generator().manual_seed(seed)
    n = len(y)
    perm = torch.randperm(n, generator=gen)
    n_val = min(max(int(n * cfg.val_fraction), 1), n - 1)
    val, tr = perm[:n_val], perm[n_val:]
    net = _MLP(x.shape[1], cfg.hidden, cfg.dropout)
    net.init_weights(gen)
    with torch.no_grad():
        net.fc2.bias.fill_(float(y[tr].mean()))  # start at the mean: early epochs learn the ranking
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    best, best_state, stale = math.inf, {k: v.clone() for k, v in net.state_dict().items()}, 0
    for _ in range(cfg.max_epochs):
        if stop is not None and stop.is_set():
            break
        order = tr[torch.randperm(len(tr), generator=gen)]
        for start in range(0, len(order), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            opt.zero_grad()
            _loss(net(x[idx], gen), y[idx], cens[idx]).backward()
            opt.step()
        with torch.no_grad():
            val_loss = float(_loss(net(x[val]), y[val], cens[val]))
        if val_loss < best - 1e-4:
            best, stale = val_loss, 0
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    net.load_state_dict(best_state)
    return net.eval()


__all__ = ["RegressorConfig", "TrainingSet", "LengthRegressor"]
