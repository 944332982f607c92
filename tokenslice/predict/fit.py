"""Fitting a ProfileCostModel on measurements: non-negative least squares (no scipy), the
transfer link, and the iteration profile (least squares, or relative error: `fit_relative`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenslice.predict.cost import BatchShape, TransferSpec
from tokenslice.predict.profile import PROFILE_FEATURES, ProfileCostModel, profile_features


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, min ||a x - b|| s.t. x >= 0 (Lawson-Hanson active set).

    Written here because scipy is not a dependency; the problems are tiny (5 columns).
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    max_iter = max_iter or 3 * n + 10
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            # Step back toward x until the first passive variable hits zero, then drop it.
            bad = passive & (s <= 0)
            alpha = np.min(x[bad] / (x[bad] - s[bad]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                s = np.zeros(n)
                break
        x = s
        w = a.T @ (b - a @ x)
    return x


def fit_transfer(samples: Sequence[tuple[int, int, float]]) -> TransferSpec:
    """Fit seconds = ops * overhead + bytes / bandwidth to measured (bytes, ops, seconds) copies."""
    if len(samples) < 2:
        raise ValueError("fit_transfer needs at least 2 samples (bytes, ops, seconds)")
    a = np.array([[float(ops), float(nb)] for nb, ops, _ in samples])
    y = np.array([float(s) for _, _, s in samples])
    scale = np.where(np.linalg.norm(a, axis=0) > 0, np.linalg.norm(a, axis=0), 1.0)
    overhead, inv_bw = nnls(a / scale, y) / scale
    if inv_bw <= 0:
        raise ValueError("transfer samples show no dependence on bytes; cannot fit a bandwidth")
    return TransferSpec(bytes_per_s=1.0 / inv_bw, op_overhead_s=float(overhead))


def fit_profile(samples: Sequence[tuple[BatchShape, float]], *, kv_bytes_per_token: int,
                transfer: TransferSpec | Sequence[tuple[int, int, float]] | None = None,
                model: str = "unknown", device: str = "unknown", tensor_parallel: int = 1) -> ProfileCostModel:
    """Least-squares fit of iteration seconds on PROFILE_FEATURES with non-negative coefficients.

    Non-negativity keeps the model monotone (more work never predicts less time), which the
    policies rely on. `transfer` is a measured TransferSpec, raw (bytes, ops, seconds) samples to
    fit one from, or None for a PCIe gen4 default (25 GB/s, 10 us per copy).
    """
    if len(samples) < len(PROFILE_FEATURES):
        raise ValueError(f"fit_profile needs at least {len(PROFILE_FEATURES)} samples, got {len(samples)}")
    a = np.array([profile_features(shape) for shape, _ in samples])
    y = np.array([float(s) for _, s in samples])
    # Columns span ~1 to ~1e6: normalise so the solver's tolerance means the same for each.
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    coef = nnls(a / scale, y) / scale
    resid = y - a @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    if transfer is None:
        transfer_spec = TransferSpec(25e9, 10e-6)
    elif isinstance(transfer, TransferSpec):
        transfer_spec = transfer
    else:
        transfer_spec = fit_transfer(transfer)
    return ProfileCostModel(coefficients=dict(zip(PROFILE_FEATURES, (float(c) for c in coef))),
                            transfer=transfer_spec, kv_bytes_per_token=kv_bytes_per_token, model=model,
                            device=device, samples=len(samples), r2=r2, tensor_parallel=tensor_parallel)


def fit_relative(samples: Sequence[tuple[BatchShape, float]], **kwargs: Any) -> ProfileCostModel:
    """`fit_profile`, then refit the coefficients to minimise *relative* error.

    Plain least squares is ruled by the largest steps (a 2k-token prefill is 100x a decode), and
    then predicts ~0 for a lone decode — the step policies and the SLO are built from. Dividing
    each row by its measured time weights every step alike. r^2 stays on the plain scale.
    """
    cost = fit_profile(samples, **kwargs)
    a = np.array([profile_features(shape) for shape, _ in samples])
    y = np.array([s for _, s in samples])
    w = 1.0 / np.maximum(y, 1e-9)
    aw = a * w[:, None]
    norms = np.linalg.norm(aw, axis=0)
    scale = np.where(norms > 0, norms, 1.0)  # same column normalisation as fit_profile
    coef = nnls(aw / scale, np.ones_like(y)) / scale
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - a @ coef) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return ProfileCostModel(coefficients=dict(zip(PROFILE_FEATURES, (float(c) for c in coef))),
                            transfer=cost.transfer, kv_bytes_per_token=cost.kv_bytes_per_token, model=cost.model,
                            device=cost.device, samples=cost.samples, r2=r2, tensor_parallel=cost.tensor_parallel)
