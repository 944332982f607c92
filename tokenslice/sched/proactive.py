"""`proactive-swap` (FastServe §4.2): KV moves between tiers ahead of need, overlapping compute,
ordered by each job's estimated next scheduled time, with a reserve of free blocks for bursts."""
from __future__ import annotations

import itertools
from typing import Any

from tokenslice.plan import StepPlan
from tokenslice.request import Request
from tokenslice.sched.preemption import ReactiveSwap


class ProactiveSwap(ReactiveSwap):
    """`proactive-swap` (FastServe §4.2): uploads overlap compute, idle jobs that will run last
    are offloaded ahead of need to keep a reserve of free blocks for bursts."""

    mode = "proactive-swap"
    async_swap_in = True  # uploads overlap this step's compute; the job runs next step
    offloads_idle = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reserve = 0  # the last burst reserve, in blocks
        self._prompt_tokens = 0  # arrivals' prompt tokens, for the reserve's job size
        self._num_arrivals = 0

    def on_arrival(self, req: Request) -> None:
        self._prompt_tokens += req.num_prompt_tokens
        self._num_arrivals += 1

    def reserved_blocks(self) -> int:
        return self.reserve

    def fast_forward_room(self, free_blocks: int) -> int:
        # Crossing into the burst reserve starts offloads: an event.
        return free_blocks - self.reserve if free_blocks >= self.reserve else free_blocks

    def burst_reserve_blocks(self) -> int:
        """Free device blocks to keep for a burst: max(K new jobs, jobs of the top K' queues
        not on device), a job sized by the mean prompt seen so far; at most a quarter of the
        pool, so the reserve never starves the running batch."""
        cfg, kv = self.config, self.kv
        jobs = cfg.burst_reserve_jobs
        if cfg.burst_reserve_queues > 0:
            waiting = sum(1 for r in self.policy.top_queue_jobs(cfg.burst_reserve_queues) if not kv.holds(r.request_id))
            jobs = max(jobs, waiting)
        per_job = kv.blocks_for_tokens(self._prompt_tokens // max(1, self._num_arrivals) + 1)
        return min(jobs * per_job, kv.device.num_blocks // 4)

    def end_plan(self, chosen: set[str], plan: StepPlan) -> None:
        """Keep the burst reserve free by offloading the idle jobs that will run last (largest
        ENST first), and upload host jobs that will run soonest (smallest ENST first) into
        free space above the reserve, so their copies overlap compute. A job moves at most once
        per transfer window, so it is never thrashed in and out in one step."""
        kv = self.kv
        target = self.reserve = self.burst_reserve_blocks()
        free = kv.device.num_free + kv.device_blocks_releasing()
        if free < target:
            idle = [r for rid, r in self.requests.items() if rid not in chosen and kv.holds(rid)
                    and not kv.in_flight(rid) and not self.stall_guard.is_protected(rid)]
            offloaded = False
            if idle:
                enst = self.next_run_estimates()
                idle.sort(key=lambda r: enst.get(r.request_id, 0.0), reverse=True)
                for r in idle:
                    if free >= target:
                        break
                    if not kv.can_swap_out(r.request_id):
                        break  # host full: keep the KV where it is (no proactive recompute)
                    free += kv.num_device_blocks(r.request_id)
                    self.move(r, "out", plan, sync=False)
                    offloaded = True
            if offloaded:
                return  # memory is tight: uploading now would only be offloaded again
        # Only a job that fits above the reserve now can be uploaded (free space only shrinks
        # below): under pressure most plans upload nothing, and skip the ENST and the ranking.
        room = kv.device.num_free - target
        on_host = [r for rid, r in self.requests.items() if not kv.in_flight(rid) and kv.residency(rid) == "host"
                   and len(kv.host_blocks(rid)) <= room]
        if not on_host:
            return
        enst = self.next_run_estimates()
        on_host = self._within_device_job_limit(on_host, target, self._now)
        on_host.sort(key=lambda r: enst.get(r.request_id, 0.0))
        for r in on_host:
            if kv.device.num_free - len(kv.host_blocks(r.request_id)) >= target:
                self.move(r, "in", plan, sync=False)

    def _within_device_job_limit(self, on_host: list[Request], reserve: int, now: float) -> list[Request]:
        """ALISE Algorithm 2: upload only jobs among the top-ranked ones the device can keep until
        they finish (the policy's device_job_limit over the pool above the burst reserve); a job
        past it would only be offloaded again as the ones ahead grow."""
        kv = self.kv
        limit = self.policy.device_job_limit((kv.device.num_blocks - reserve) * kv.block_size, now)
        if limit is None:
            return on_host
        keep = {r.request_id for r in itertools.islice(self.policy.ranked(now), limit)}
        return [r for r in on_host if r.request_id in keep]
