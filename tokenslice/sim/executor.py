"""SimulatedExecutor: runs no model; each step costs what the CostModel says (docs/DESIGN.md).

Sampled tokens are a placeholder id: simulated requests end at the trace's output length
(`Request.eos_after`, a simulated EOS), as serving papers replay datasets.

KV swaps cost bytes / host-link bandwidth plus a per-copy overhead (one copy per contiguous
run of blocks). Synchronous swaps add to the step; asynchronous ones queue on the link, one
channel per direction (the link is full duplex), and overlap compute.
"""
from __future__ import annotations

import heapq
from typing import Protocol

from tokenslice.exec.base import ImmediateExecutor
from tokenslice.plan import StepPlan, StepResult, copy_runs
from tokenslice.predict.cost import BatchShape, CostModel
from tokenslice.request import Request

PLACEHOLDER_TOKEN = 0
# Host time of one constrained row's grammar work in a step (its mask filled and applied, its
# token accepted): benchmarks/serving/structured_outputs.py, SmolLM2 on 2 CPU cores, 16 rows.
GRAMMAR_ROW_S = 44e-6  # 0.71 ms per 16-row step (2026-11-29)
# Offloaded KV in int8 (ALISE §3.2): one byte per value plus, per channel per block, an fp32
# span and a zero point in the KV dtype (fp16: 4 + 2 bytes), as model/kv_quant.py stores them.
SCALE_ZERO_BYTES = 6


def offload_block_bytes(block_size: int, kv_bytes_per_token: int, offload_dtype: str = "auto",
                        value_bytes: int = 2) -> int:
    """Bytes one KV block occupies on host (and moves over the link)."""
    full = block_size * kv_bytes_per_token
    if offload_dtype != "int8":
        return full
    channels = kv_bytes_per_token // value_bytes  # values per token = channels of a block
    return channels * (block_size + SCALE_ZERO_BYTES)


class Clock(Protocol):
    def now(self) -> float: ...


class SimulatedExecutor(ImmediateExecutor):
    token = PLACEHOLDER_TOKEN

    def __init__(self, cost: CostModel, clock: Clock | None = None, block_bytes: int = 0) -> None:
        super().__init__()
        cost.check_fits()  # a model whose weights overflow each GPU has no time to simulate
        self.cost = cost
        self.clock = clock
        self.block_bytes = block_bytes  # one block as moved over the host link
        self._link_free = {"out": 0.0, "in": 0.0}  # when each direction's channel is idle
        self._pending: list[tuple[float, int, str, float]] = []  # (done time, order, request id, copy seconds)
        self._order = 0

    def copy_seconds(self, pairs: list[tuple[int, int]]) -> float:
        if not pairs:
            return 0.0
        return self.cost.transfer_seconds(len(pairs) * self.block_bytes, len(copy_runs(pairs)))

    def repeat_decode_times(self, reqs: list[Request], k: int, now: float, first_step: int = 0,
                            loop_s: float = 0.0, overlap: bool = False) -> tuple[list[float], list[float]]:
        """Durations and end times of decode steps first_step .. first_step + k - 1 of this batch,
        starting at `now`; contexts grow by one a step. Ends accumulate one by one, as the clock
        would step by step; each step's end also counts `loop_s`, the engine loop's own time
        (with `overlap`, async scheduling: only where it outlasts the step)."""
        n = len(reqs)
        ctx = sum(r.num_tokens for r in reqs)
        grammar_s = GRAMMAR_ROW_S * sum(r.params.structured is not None for r in reqs)
        durations, ends = [], []
        t = now
        for j in range(first_step, first_step + k):
            d = self.cost.iteration_seconds(BatchShape(decode_seqs=n, context_tokens=ctx + n * j)) + grammar_s
            t += max(d, loop_s) if overlap else d + loop_s
            durations.append(d)
            ends.append(t)
        return durations, ends

    @staticmethod
    def shape(plan: StepPlan) -> BatchShape:
        return BatchShape.from_lengths(prefill=[(s.num_tokens, s.start_pos) for s in plan.prefill],
                                       decode=[s.start_pos + 1 for s in plan.decode])

    def close(self) -> None:
        pass  # nothing runs in the background

    def now(self) -> float:
        return self.clock.now() if self.clock is not None else 0.0

    def start_copies(self, plan: StepPlan, t0: float) -> float:
        """Queue the plan's copies on the link at `t0`; returns its synchronous copy seconds
        (async copies start after them and overlap compute)."""
        out_s, in_s = self.copy_seconds(plan.swap_out), self.copy_seconds(plan.swap_in)
        sync_s = out_s + in_s  # swap-ins may land in blocks the swap-outs free: one after the other
        for direction, d in (("out", out_s), ("in", in_s)):
            if d:
                self._link_free[direction] = max(self._link_free[direction], t0) + d
        for t in plan.async_transfers:
            start = max(t0 + sync_s, self._link_free[t.direction])
            copy_s = self.copy_seconds(t.pairs)
            done = start + copy_s
            self._link_free[t.direction] = done
            heapq.heappush(self._pending, (done, self._order, t.request_id, copy_s))
            self._order += 1
        return sync_s

    def next_copy_done(self) -> float | None:
        """When the earliest async copy in flight lands; None if none is."""
        return self._pending[0][0] if self._pending else None

    def take_copies_done(self, until: float) -> tuple[list[str], dict[str, float]]:
        """Async copies landed by `until`: request ids in completion order, and their copy seconds."""
        done_ids, durations = [], {}
        while self._pending and self._pending[0][0] <= until:
            _, _, rid, copy_s = heapq.heappop(self._pending)
            done_ids.append(rid)
            durations[rid] = copy_s
        return done_ids, durations

    @staticmethod
    def sampled(plan: StepPlan) -> dict[str, int]:
        return {s.request_id: PLACEHOLDER_TOKEN for s in plan.slices if s.sample}

    def run(self, plan: StepPlan) -> StepResult:
        t0 = self.now()
        sync_s = self.start_copies(plan, t0)
        step = sync_s + (0.0 if plan.is_empty else self.cost.iteration_seconds(self.shape(plan)))
        step += GRAMMAR_ROW_S * sum(s.sample and s.params.structured is not None for s in plan.slices)
        if step == 0.0 and self._pending:  # nothing to compute: wait for the next copy
            step = max(0.0, self._pending[0][0] - t0)
        done_ids, durations = self.take_copies_done(t0 + step)
        return StepResult(sampled=self.sampled(plan), step_seconds=step, transfer_seconds=sync_s,
                          transfers_done=done_ids, transfer_durations=durations)
