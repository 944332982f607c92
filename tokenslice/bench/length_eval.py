"""Quality and latency of an output-length predictor on held-out prompts, against three baselines
fitted on the predictor's own history (its training set): the training mean, a linear regression
on prompt length, and the MLP regressor alone.

Metrics: Spearman rank correlation (what a shortest-job-first scheduler needs right), mean absolute
error (tokens), mean relative error |pred - true| / true, bucket accuracy (4 equal-frequency
buckets, quartile boundaries of the training lengths), and per-prompt latency: each prompt is
predicted alone, as a request arriving at the server would be, with the embedding cache off.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenslice.bench.metrics import percentile
from tokenslice.predict.blend import spearman

if TYPE_CHECKING:  # the caller builds the predictor (torch and faiss); scoring it needs neither
    from tokenslice.predict.length import LengthPredictor

METRIC_KEYS = ("n", "spearman", "mean_abs_error", "mean_rel_error", "bucket_accuracy", "median_latency_ms",
               "p99_latency_ms")
BASELINES = ("train_mean", "prompt_length", "mlp_only")
BATCH = 32


def score(pred: Sequence[float], latencies_s: Sequence[float], truth: Sequence[float],
          boundaries: np.ndarray) -> dict[str, Any]:
    """The metrics of METRIC_KEYS for one method."""
    p = np.asarray(pred, dtype=float)
    t = np.asarray(truth, dtype=float)
    bucket = np.searchsorted(boundaries, p, side="right") == np.searchsorted(boundaries, t, side="right")
    lat_ms = [1000 * s for s in latencies_s]
    return {"n": len(t), "spearman": spearman(p, t), "mean_abs_error": float(np.abs(p - t).mean()),
            "mean_rel_error": float((np.abs(p - t) / np.maximum(t, 1)).mean()),
            "bucket_accuracy": float(bucket.mean()), "median_latency_ms": percentile(lat_ms, 50),
            "p99_latency_ms": percentile(lat_ms, 99), "mean_latency_ms": float(np.mean(lat_ms))}


def _timed(fn: Callable[[str], float], prompts: Sequence[str]) -> tuple[list[float], list[float]]:
    preds, secs = [], []
    for prompt in prompts:
        start = time.perf_counter()
        preds.append(fn(prompt))
        secs.append(time.perf_counter() - start)
    return preds, secs


def fit_prompt_length(predictor: LengthPredictor) -> tuple[float, float]:
    """(slope, intercept) of the prompt-length baseline: least-squares output length on prompt
    length (the embedder's token count, the length feature the MLP sees) over the exact history."""
    x = predictor.exact_prompt_tokens.astype(float)
    y = predictor.exact_lengths.astype(float)
    if len(x) < 2 or x.std() == 0:
        return 0.0, float(y.mean()) if len(y) else 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def evaluate(predictor: LengthPredictor, prompts: Sequence[str], truth: Sequence[int]) -> dict[str, Any]:
    """Score `predictor` on (prompt, true output length) pairs; read-only (observes nothing).

    The result has METRIC_KEYS for the predictor, `baselines` with the same keys per baseline,
    `batched_ms_per_prompt` (predict() over batches of 32), and the predictor's knobs.
    """
    if not prompts or len(prompts) != len(truth):
        raise ValueError("need the same, non-zero number of prompts and lengths")
    train_lens = predictor.exact_lengths.astype(float)
    if len(train_lens) < 4:
        raise ValueError("the predictor's history has fewer than 4 exact records: nothing to compare against")
    boundaries = np.quantile(train_lens, [0.25, 0.5, 0.75])
    prompts = list(prompts)

    preds, secs = _timed(predictor.predict_one, prompts)
    start = time.perf_counter()
    for i in range(0, len(prompts), BATCH):
        predictor.predict(prompts[i:i + BATCH])
    batched = (time.perf_counter() - start) / len(prompts)
    result = score(preds, secs, truth, boundaries)
    result["batched_ms_per_prompt"] = 1000 * batched

    mean = float(train_lens.mean())
    baselines = {"train_mean": score(*_timed(lambda _: mean, prompts), truth, boundaries)}

    slope, intercept = fit_prompt_length(predictor)
    count = predictor.embedder.count_tokens
    baselines["prompt_length"] = score(*_timed(lambda p: float(slope * count([p])[0] + intercept), prompts),
                                       truth, boundaries)

    if predictor.regressor is not None:
        mlp_preds, mlp_secs = _timed(lambda p: predictor.predict_mlp([p])[0], prompts)
        baselines["mlp_only"] = score(mlp_preds, mlp_secs, truth, boundaries)
    else:
        baselines["mlp_only"] = {k: None for k in METRIC_KEYS} | {"n": len(prompts)}
    result["baselines"] = baselines
    cfg = predictor.config
    result["predictor"] = {"records": predictor.num_records, "k": cfg.k, "threshold": cfg.threshold,
                           "knn_weight": cfg.knn_weight, "tune_spearman": predictor.tune_score}
    return result


def format_table(result: dict[str, Any]) -> str:
    """The predictor and its baselines, one row each."""
    rows = [("predictor", result)] + [(name, result["baselines"][name]) for name in BASELINES]
    head = f"{'method':<14}{'n':>6}{'spearman':>10}{'MAE':>9}{'rel err':>9}{'bucket':>8}{'p50 ms':>9}{'p99 ms':>9}"
    lines = [head, "-" * len(head)]

    def fmt(v: Any, width: int, spec: str) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"

    for name, r in rows:
        lines.append(f"{name:<14}{r['n']:>6}" + fmt(r["spearman"], 10, ".3f") + fmt(r["mean_abs_error"], 9, ".1f")
                     + fmt(r["mean_rel_error"], 9, ".2f") + fmt(r["bucket_accuracy"], 8, ".3f")
                     + fmt(r["median_latency_ms"], 9, ".2f") + fmt(r["p99_latency_ms"], 9, ".2f"))
    if "batched_ms_per_prompt" in result:
        lines.append(f"predictor, batches of {BATCH}: {result['batched_ms_per_prompt']:.2f} ms per prompt")
    return "\n".join(lines)
