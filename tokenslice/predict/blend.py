"""How the output-length predictor turns neighbours and the regressor into one number, and how
its knobs are chosen (ALISE §3.1, Algorithm 1: retrieve the top-k similar past prompts; if they
are similar enough, predict their similarity-weighted average length, else ask the regressor).

Two departures from the paper's rule, both chosen by cross-validation on training data only:
lengths are averaged in log space (a geometric mean: one 2,000-token neighbour no longer swamps
nine 50-token ones), and when neighbours pass the threshold their average is blended with the
regressor's estimate rather than replacing it (with knn_weight 1.0 this is the paper's rule).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

K_GRID = (5, 10, 20, 50)
THRESHOLD_GRID = (0.0, 0.5, 0.6, 0.7, 0.8)
KNN_WEIGHT_GRID = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0)


@dataclass(frozen=True)
class BlendParams:
    k: int = 20
    threshold: float = 0.0  # neighbours below this cosine similarity are ignored
    knn_weight: float = 0.5  # weight of the neighbours' mean log length against the regressor's


def neighbour_mean(sims: np.ndarray, log_lens: np.ndarray, k: int, threshold: float) -> np.ndarray:
    """Similarity-weighted mean of log lengths over each row's first k neighbours with similarity
    >= threshold; NaN where none qualifies. sims/log_lens: [n, >=k], best first; missing
    neighbours have similarity -inf."""
    s = sims[:, :k]
    ok = np.isfinite(s) & (s >= threshold)
    w = np.where(ok, np.maximum(s, 1e-6), 0.0)
    total = w.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (w * np.where(ok, log_lens[:, :k], 0.0)).sum(1) / total
    return np.where(total > 0, mean, np.nan)


def combine(knn_log: np.ndarray, mlp_log: np.ndarray | None, fallback_log: float, knn_weight: float) -> np.ndarray:
    """Log-length prediction per row: blend where both exist, else whichever exists, else fallback."""
    has_knn = ~np.isnan(knn_log)
    if mlp_log is None:
        return np.where(has_knn, knn_log, fallback_log)
    return np.where(has_knn, knn_weight * np.nan_to_num(knn_log) + (1 - knn_weight) * mlp_log, mlp_log)


def spearman(pred: np.ndarray, truth: np.ndarray) -> float | None:
    """Spearman rank correlation (average ranks for ties); None when either side is constant."""
    a, b = _ranks(np.asarray(pred, dtype=float)), _ranks(np.asarray(truth, dtype=float))
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    ranks[order] = np.arange(len(x), dtype=float)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def tune_blend(folds: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]],
               fallback_log: float) -> tuple[BlendParams, float]:
    """Pick (k, threshold, knn_weight) maximising the mean Spearman over validation folds.

    Each fold is (neighbour sims [n, >=max k], neighbour log lengths, regressor log predictions
    or None, true lengths), all computed without the fold's own records. Ties keep the earlier
    grid point, i.e. the smaller k, threshold and knn_weight.
    """
    best, best_score = BlendParams(), -np.inf
    for k, thr, wt in itertools.product(K_GRID, THRESHOLD_GRID, KNN_WEIGHT_GRID):
        scores = []
        for sims, logs, mlp, truth in folds:
            pred = combine(neighbour_mean(sims, logs, k, thr), mlp, fallback_log, wt)
            scores.append(spearman(pred, truth) or 0.0)
        score = float(np.mean(scores))
        if score > best_score + 1e-9:
            best, best_score = BlendParams(k, thr, wt), score
    return best, best_score
