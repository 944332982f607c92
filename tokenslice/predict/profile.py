"""ProfileCostModel: iteration time fitted on this machine's measured steps (docs/DESIGN.md, "CostModel").

A non-negative linear model over batch features (ALISE §3.1: iteration time is linear in the
batch's token counts), built by `fit_profile` (fit.py) from (BatchShape, seconds) samples or by
sim/trace_fit.py from step traces, and stored as JSON. Step traces add the engine loop's own
per-step time as terms of its own (LOOP_FEATURES).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tokenslice.predict.cost import BatchShape, CostModel, LoopShape, TransferSpec

# Feature order of the fitted profile; names are the JSON coefficient keys.
PROFILE_FEATURES = ("base", "prefill_tokens", "decode_seqs", "context_tokens", "prefill_context",
                    "prefill_seqs", "has_prefill", "has_decode")
# Profiles written before the last three existed load with those terms at zero.
OPTIONAL_FEATURES = ("prefill_seqs", "has_prefill", "has_decode")


def profile_features(shape: BatchShape) -> list[float]:
    """[1, prefill tokens, decode seqs, context tokens, prefill attention pairs] (ALISE §3.1), plus
    per-prefill-chunk and per-attention-group terms: the engine runs prefill and decode attention
    as separate groups, whose fixed costs dominate a small model's step."""
    return [1.0, float(shape.prefill_tokens), float(shape.decode_seqs), float(shape.context_tokens),
            float(shape.prefill_context), float(shape.prefill_seqs), float(shape.prefill_seqs > 0),
            float(shape.decode_seqs > 0)]


# The engine loop's own time per step (`loop_seconds`), fitted on step traces; JSON key "loop".
# Profiles without it (synthetic sweeps, older files) have every term at zero.
LOOP_FEATURES = ("base", "live", "sampled", "arrivals")


def loop_features(loop: LoopShape) -> list[float]:
    return [1.0, float(loop.live), float(loop.sampled), float(loop.arrivals)]


def _stage_terms(pipeline_parallel: int, stage_factors: list[float] | None, stage_cv: list[float] | None
                 ) -> tuple[list[float], list[float]]:
    """Each stage's time factor (default 1) and spread (default 0), checked: one per stage."""
    factors = [float(f) for f in stage_factors] if stage_factors else [1.0] * pipeline_parallel
    if len(factors) != pipeline_parallel or min(factors) <= 0:
        raise ValueError(f"stage_factors must be {pipeline_parallel} positive numbers, got {stage_factors}")
    spread = [float(c) for c in stage_cv] if stage_cv else [0.0] * pipeline_parallel
    if len(spread) != pipeline_parallel or min(spread) < 0:
        raise ValueError(f"stage_cv must be {pipeline_parallel} numbers >= 0, got {stage_cv}")
    return factors, spread


class ProfileCostModel(CostModel):
    """Linear cost fitted to iterations measured on this machine (see `fit_profile`)."""

    kind = "profile"

    def __init__(self, coefficients: dict[str, float], transfer: TransferSpec, kv_bytes_per_token: int,
                 model: str = "unknown", device: str = "unknown", samples: int = 0,
                 r2: float | None = None, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 p2p: TransferSpec | None = None, activation_bytes_per_token: int = 0,
                 loop: dict[str, float] | None = None, stage_factors: list[float] | None = None,
                 stage_cv: list[float] | None = None) -> None:
        """`tensor_parallel`: GPUs the measured engine sharded the model over (its iteration times
        include their collectives; KV bytes per token are the whole model's).
        `pipeline_parallel`: stages the measured pass went through, one batch at a time; a stage
        takes an equal share of it less the sends between stages, each `p2p` (per send, per byte)
        for `activation_bytes_per_token` bytes a token. `stage_factors`: each stage's time as a
        multiple of that equal share (default 1 each), fitted to a real pipeline's stage timers: a
        split even in layers but not in time (the LM head), stages slowed by sharing cores;
        `stage_cv` their measured per-batch spread (std / mean, default 0): with as many batches in
        flight as stages there is no slack, so a late stage stalls the next one.
        `loop`: coefficients over LOOP_FEATURES (missing ones are 0)."""
        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise ValueError(f"tensor_parallel and pipeline_parallel must be >= 1, got {tensor_parallel}, "
                             f"{pipeline_parallel}")
        missing = [k for k in PROFILE_FEATURES if k not in coefficients and k not in OPTIONAL_FEATURES]
        if missing:
            raise ValueError(f"profile coefficients missing {missing}; need {list(PROFILE_FEATURES)}")
        self.coefficients = {k: float(coefficients.get(k, 0.0)) for k in PROFILE_FEATURES}
        self._weights = np.array([self.coefficients[k] for k in PROFILE_FEATURES])
        self.transfer = transfer
        self._kv_bytes_per_token = int(kv_bytes_per_token)
        self.model = model
        self.device = device
        self.samples = samples
        self.r2 = r2
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.p2p = p2p or TransferSpec(float("inf"), 0.0)
        self.activation_bytes_per_token = int(activation_bytes_per_token)
        unknown = set(loop or {}) - set(LOOP_FEATURES)
        if unknown:
            raise ValueError(f"unknown loop terms {sorted(unknown)}; expected {list(LOOP_FEATURES)}")
        self.loop = {k: float((loop or {}).get(k, 0.0)) for k in LOOP_FEATURES}
        self._loop_weights = np.array([self.loop[k] for k in LOOP_FEATURES])
        self.stage_factors, self.stage_cv = _stage_terms(pipeline_parallel, stage_factors, stage_cv)
        self._stages_fitted = self.stage_factors != [1.0] * pipeline_parallel

    @property
    def name(self) -> str:
        suffix = f":tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        suffix += f":pp{self.pipeline_parallel}" if self.pipeline_parallel > 1 else ""
        return f"{self.model}@{self.device}{suffix}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    def iteration_seconds(self, shape: BatchShape) -> float:
        if shape.is_empty():
            return 0.0
        if self._stages_fitted:  # the fitted stages, not the measured pass
            return sum(self.stage_seconds(shape)) + (self.pipeline_parallel - 1) * self.p2p_seconds(shape.num_tokens)
        return self._pass_seconds(shape)

    def _pass_seconds(self, shape: BatchShape) -> float:
        return max(float(np.dot(self._weights, profile_features(shape))), 0.0)

    def stage_seconds(self, shape: BatchShape) -> list[float]:
        m = self.pipeline_parallel
        compute = max(self._pass_seconds(shape) - (m - 1) * self.p2p_seconds(shape.num_tokens), 0.0)
        return [f * compute / m for f in self.stage_factors]

    def p2p_seconds(self, num_tokens: int) -> float:
        if self.pipeline_parallel == 1 or num_tokens <= 0:
            return 0.0
        return self.p2p.seconds(num_tokens * self.activation_bytes_per_token)

    def stage_spread(self) -> list[float]:
        return list(self.stage_cv)

    def transfer_seconds(self, num_bytes: int, num_ops: int = 1) -> float:
        return self.transfer.seconds(num_bytes, num_ops)

    @property
    def has_loop_cost(self) -> bool:
        return any(self.loop.values())

    def loop_seconds(self, loop: LoopShape) -> float:
        if not self.has_loop_cost:
            return 0.0
        return max(float(np.dot(self._loop_weights, loop_features(loop))), 0.0)

    def to_dict(self) -> dict[str, Any]:
        pipeline = {} if self.pipeline_parallel == 1 else {
            "pipeline_parallel": self.pipeline_parallel, "activation_bytes_per_token": self.activation_bytes_per_token,
            "p2p": {"bytes_per_s": self.p2p.bytes_per_s, "op_overhead_s": self.p2p.op_overhead_s},
            "stage_factors": list(self.stage_factors), "stage_cv": list(self.stage_cv)}
        return {"kind": self.kind, "model": self.model, "device": self.device,
                "coefficients": dict(self.coefficients), "loop": dict(self.loop),
                "transfer": {"bytes_per_s": self.transfer.bytes_per_s, "op_overhead_s": self.transfer.op_overhead_s},
                "kv_bytes_per_token": self.kv_bytes_per_token, "samples": self.samples, "r2": self.r2,
                "tensor_parallel": self.tensor_parallel, **pipeline}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileCostModel:
        t, p2p = data["transfer"], data.get("p2p")
        return cls(coefficients=data["coefficients"],
                   transfer=TransferSpec(float(t["bytes_per_s"]), float(t["op_overhead_s"])),
                   kv_bytes_per_token=int(data["kv_bytes_per_token"]), model=data.get("model", "unknown"),
                   device=data.get("device", "unknown"), samples=int(data.get("samples", 0)), r2=data.get("r2"),
                   tensor_parallel=int(data.get("tensor_parallel", 1)),
                   pipeline_parallel=int(data.get("pipeline_parallel", 1)),
                   p2p=TransferSpec(float(p2p["bytes_per_s"]), float(p2p["op_overhead_s"])) if p2p else None,
                   activation_bytes_per_token=int(data.get("activation_bytes_per_token", 0)), loop=data.get("loop"),
                   stage_factors=data.get("stage_factors"), stage_cv=data.get("stage_cv"))
