"""Refinements recorded by a real engine, replayed where no hidden states exist (the simulator).

A recording is JSON lines, one per refined prediction: {"id": request id, "output_tokens": tokens
generated when the state was captured, "predicted_output_tokens": the new predicted total}
(OnlineLengthPredictor(record=...) writes them). `RecordedRefinements` stands in for the engine's
length predictor: after each step it hands back, for every request of the step, the latest
recorded prediction whose capture point the request has reached, so srpt-predicted re-ranks as
it did live. A step the simulator fast-forwards in bulk applies its points when the run ends.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tokenslice.plan import StepPlan
from tokenslice.request import Request


class RecordedRefinements:
    def __init__(self, points: Mapping[str, list[tuple[int, int]]]) -> None:
        """`points`: request id -> (output tokens at capture, predicted total), any order."""
        self._points = {rid: sorted(p) for rid, p in points.items()}
        self._next: dict[str, int] = {}  # index of each request's next point to apply
        self.num_applied = 0

    @classmethod
    def load(cls, path: str | Path) -> RecordedRefinements:
        points: dict[str, list[tuple[int, int]]] = {}
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                points.setdefault(str(r["id"]), []).append((int(r["output_tokens"]), int(r["predicted_output_tokens"])))
        return cls(points)

    def predict(self, req: Request, text: str | None) -> None:
        """Arrival predictions come with the workload (or the policy's fallback)."""

    def mark(self, plan: StepPlan) -> None:
        """Nothing to capture: the states were read when the recording was made."""

    def refine(self, hidden: Mapping[str, list[float]], plan: StepPlan, requests: Mapping[str, Request]
               ) -> dict[str, int]:
        """Request id -> its latest recorded prediction whose capture point the request has
        reached (output tokens before this step's token, as live)."""
        out = {}
        for s in plan.slices:
            rid = s.request_id
            points, req = self._points.get(rid), requests.get(rid)
            if not points or req is None:
                continue
            i = self._next.get(rid, 0)
            while i < len(points) and points[i][0] <= req.num_output_tokens:
                out[rid] = max(points[i][1], req.num_output_tokens + 1)
                i += 1
            if rid in out:
                self._next[rid] = i
                self.num_applied += 1
        return out

    def observe(self, finished: list[Request]) -> None:
        for req in finished:
            self._next.pop(req.request_id, None)

    def close(self) -> None:
        pass


__all__ = ["RecordedRefinements"]
