"""PipelinedSimulatedExecutor: the simulator with pipeline stages and several batches in flight
(FastServe §4.3: M stages, up to M batches in the pipe at once).

A batch enters stage 0 when that stage is free, runs each stage for the cost model's
`stage_seconds`, and crosses each stage boundary in `p2p_seconds`; a stage takes the next batch
as soon as it is done with the previous one. Its result is ready (`StepResult.done_at`) when it
leaves the last stage. With fewer batches ready than stages, stages idle: the pipeline bubble,
which `stage_busy_s` measures. Synchronous swaps are distributed as in FastServe Fig. 10: each
stage copies its own layers' KV before computing the batch (its share over its own host
links), so they repeat down the pipe. Asynchronous copies overlap as in SimulatedExecutor.
A cost model with a measured spread per stage (`CostModel.stage_spread`) has each batch's stage
time drawn around its mean (lognormal of that std / mean, seeded): jitter is what stalls a pipe
that holds no more batches than stages.
"""
from __future__ import annotations

import math
import random
from collections import deque

from tokenslice.sim.executor import Clock, SimulatedExecutor
from tokenslice.plan import StepPlan, StepResult
from tokenslice.predict.cost import CostModel


class PipelinedSimulatedExecutor(SimulatedExecutor):
    def __init__(self, cost: CostModel, clock: Clock | None = None, block_bytes: int = 0,
                 max_in_flight: int | None = None, seed: int = 0) -> None:
        """`max_in_flight`: batches the engine keeps in the pipe; default one per stage. `seed`:
        for the stage times' spread, if the cost model has one."""
        super().__init__(cost, clock, block_bytes)
        self.num_stages = cost.pipeline_parallel
        self.max_in_flight = max_in_flight or self.num_stages
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        self._stage_free = [0.0] * self.num_stages  # when each stage is done with its last batch
        self.stage_busy_s = [0.0] * self.num_stages  # seconds each stage computed or copied
        self._flight: deque[StepResult] = deque()
        # Lognormal sigma per stage for a mean-1 factor of spread cv: sigma^2 = ln(1 + cv^2).
        self._sigma = [math.sqrt(math.log1p(cv * cv)) for cv in cost.stage_spread()]
        self._rng = random.Random(seed)

    def submit(self, plan: StepPlan) -> None:
        t0 = self.now()
        sync_s = self.start_copies(plan, t0)
        stages = [0.0] * self.num_stages if plan.is_empty else self.cost.stage_seconds(self.shape(plan))
        if any(self._sigma):
            stages = [s * self._rng.lognormvariate(-sg * sg / 2, sg) if sg else s for s, sg in zip(stages, self._sigma)]
        hop = self.cost.p2p_seconds(plan.num_tokens)
        t = t0
        for i, compute_s in enumerate(stages):
            start = max(t, self._stage_free[i])
            busy = sync_s + compute_s
            self._stage_free[i] = start + busy
            self.stage_busy_s[i] += busy
            t = start + busy + (hop if i + 1 < self.num_stages else 0.0)
        # The batch's own time in the pipe, waits for busy stages left out: its service.
        own = sum(stages) + hop * (self.num_stages - 1) + sync_s * self.num_stages
        pending = self.next_copy_done()
        if own == 0.0 and pending is not None:  # nothing to compute: wait for the next copy
            t = max(t, pending)
            own = t - t0
        self._flight.append(StepResult(sampled=self.sampled(plan), step_seconds=own,
                                       transfer_seconds=sync_s * self.num_stages, done_at=t))

    def poll(self) -> StepResult:
        """The oldest batch's result, with the async copies landed by the time it is ready."""
        if not self._flight:
            raise RuntimeError("poll() with no plan submitted")
        result = self._flight.popleft()
        assert result.done_at is not None
        result.transfers_done, result.transfer_durations = self.take_copies_done(result.done_at)
        return result

    @property
    def num_in_flight(self) -> int:
        return len(self._flight)

    def next_ready(self) -> float | None:
        """When the oldest batch in flight is ready; None if none is."""
        return self._flight[0].done_at if self._flight else None
