"""Fairness policies (FastSwitch's setting): `priority`, an external priority that may change
while a request lives, and `vtc`, the Virtual Token Counter's per-user fair share (Sheng et al.,
OSDI'24 "Fairness in Serving Large Language Models")."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from tokenslice.config import parse_vtc_weights
from tokenslice.request import Request
from tokenslice.sched.policy import LiveSetPolicy, Policy, PolicyContext, SortedKeys


class PriorityPolicy(LiveSetPolicy):
    """Lower `Request.priority` first, arrival order among equals (vLLM's priority scheduling).
    The order changes only on arrivals, finishes and priority updates, all of which happen
    between steps, so a batch may repeat until the next one (LiveSetPolicy)."""

    name = "priority"
    uses_priority = True

    def __init__(self) -> None:
        super().__init__()
        self._keys = SortedKeys()  # (priority, arrival order, id): the ranking
        self._order = itertools.count()

    def on_arrival(self, req: Request, now: float) -> None:
        super().on_arrival(req, now)
        self._keys.put(req.request_id, (req.priority, next(self._order), req.request_id))

    def on_finish(self, req: Request) -> None:
        super().on_finish(req)
        self._keys.pop(req.request_id)

    def on_priority_change(self, req: Request, old_priority: int, now: float) -> None:
        key = self._keys.get(req.request_id)
        if key is not None:  # keeps its place in arrival order among its new peers
            self._keys.put(req.request_id, (req.priority, key[1], req.request_id))

    def ranked(self, now: float) -> Iterator[Request]:
        return (self._live[k[2]] for k in self._keys)

    def describe_queues(self) -> dict[str, Any]:
        """Priority classes, best first, each in arrival order."""
        classes: list[dict[str, Any]] = []
        for priority, _, rid in self._keys:
            if not classes or classes[-1]["priority"] != priority:
                classes.append({"priority": priority, "requests": []})
            classes[-1]["requests"].append(rid)
        return {"kind": "priority", "classes": classes}


class VTCPolicy(Policy):
    """Virtual Token Counter (Sheng et al. §4, Algorithm 2), preemptive at token granularity.

    Each user has a counter of the service it received: input tokens x w_in + output tokens x
    w_out, divided by its share. The ranking repeats VTC's selection loop: take the next request
    (arrival order) of the user with the least counter, add the service that request would get
    in this step to a copy of the counter, pick again; so a batch mixes users in proportion and
    stays stable while their counters rise together. A user that becomes active is lifted to the
    least counter among active users (§4.1: idling banks no credit). Recomputing dropped KV is
    the server's overhead and charges nothing: only first-time prompt tokens and sampled tokens
    count, as in the paper's definition of service.

    Fairness (§4.2, Theorem 4.4's setting): with two users that each keep at least max_batch_size
    live requests, memory ample and max_tokens_per_step covering the batch's chunks, the batch is
    exactly the selection loop's, so their counters never differ by more than one request's
    service in one step, and their services over any interval by at most twice that
    (tests/test_fair.py checks it)."""

    name = "vtc"

    def __init__(self, ctx: PolicyContext) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.w_in = cfg.vtc_input_weight
        self.w_out = cfg.vtc_output_weight
        self.shares = parse_vtc_weights(cfg.vtc_weights)
        self.counters: dict[str | None, float] = {}
        self._live: dict[str | None, dict[str, Request]] = {}  # per active user, arrival order
        self._seq: dict[str, int] = {}
        self._order = itertools.count()
        # Service already charged per request: prompt tokens (high-water mark) and output tokens.
        self._charged: dict[str, tuple[int, int]] = {}

    def share(self, user: str | None) -> float:
        return self.shares.get(user, 1.0) if user is not None else 1.0

    # ---- membership ---------------------------------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        user = req.user
        queue = self._live.get(user)
        if queue is None:  # the user becomes active: lift it (VTC §4.1)
            active = [self.counters[u] for u in self._live]
            own = self.counters.get(user, 0.0)
            self.counters[user] = max(own, min(active)) if active else own
            queue = self._live[user] = {}
        queue[req.request_id] = req
        self._seq[req.request_id] = next(self._order)
        self._charged[req.request_id] = (0, 0)

    def on_finish(self, req: Request) -> None:
        rid, user = req.request_id, req.user
        if rid not in self._charged:
            return
        self._charge(req)  # the finishing step's service: update() finishes before on_step
        del self._charged[rid], self._seq[rid]
        queue = self._live[user]
        del queue[rid]
        if queue:
            return
        del self._live[user]
        if not self._live:
            # Idle: everyone got what they asked for, so nobody's past service counts against
            # them any more (as virtual time restarts in fair queueing); also bounds the table.
            self.counters.clear()
        elif self.counters[user] <= min(self.counters[u] for u in self._live):
            # The least active counter never falls while anyone is active, so a return would
            # lift this user at least to where it is: forgetting it changes nothing.
            del self.counters[user]

    # ---- charging -----------------------------------------------------------------------------
    def _charge(self, req: Request) -> None:
        rid = req.request_id
        prompt_done, out_done = self._charged[rid]
        prompt = min(req.num_computed_tokens, req.num_prompt_tokens)
        new_in = prompt - prompt_done if prompt > prompt_done else 0
        new_out = req.num_output_tokens - out_done
        if not new_in and not new_out:
            return
        self._charged[rid] = (max(prompt, prompt_done), req.num_output_tokens)
        share = self.share(req.user)
        c = self.counters[req.user]
        if new_in:
            c += self.w_in * new_in / share
        unit = self.w_out / share
        # One addition per token, so a run of steps charged at once (fast-forward) adds exactly
        # what step-by-step charging adds.
        for _ in range(new_out):
            c += unit
        self.counters[req.user] = c

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        for req in ran:
            if req.request_id in self._charged:
                self._charge(req)

    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        """Counters move every step, but when the batch holds every live request the batch
        cannot change before an arrival or a finish (which end a fast-forward anyway); otherwise
        no bound is computed and nothing repeats."""
        live = sum(len(q) for q in self._live.values())
        return len(ends) if len(ran) == live else 1

    def describe_queues(self) -> dict[str, Any]:
        """Active users, least counter (next served) first, each with its requests in arrival order."""
        users = sorted(self._live.items(), key=lambda kv: self.counters[kv[0]])
        return {"kind": "vtc", "users": [{"user": u, "counter": self.counters[u], "share": self.share(u),
                                          "requests": list(queue)} for u, queue in users]}

    # ---- order --------------------------------------------------------------------------------
    def _step_service(self, req: Request, budget: int) -> tuple[float, int]:
        """Service `req` would be charged for running next with `budget` step tokens left (the
        scheduler's chunking), and the tokens it would take."""
        computed = req.num_computed_tokens
        left = req.num_tokens - computed
        chunk = min(left, budget) if budget > 0 else left
        prompt_done = self._charged[req.request_id][0]
        new_in = min(computed + chunk, req.num_prompt_tokens) - prompt_done
        service = self.w_in * new_in if new_in > 0 else 0.0
        if chunk == left:  # the chunk reaches the end: it samples a token
            service += self.w_out
        return service / self.share(req.user), chunk

    def ranked(self, now: float) -> Iterator[Request]:
        heads: dict[str | None, tuple[Request, Iterator[Request]]] = {}
        heap: list[tuple[float, int, str | None]] = []
        for user, queue in self._live.items():
            it = iter(queue.values())
            head = next(it)
            heads[user] = (head, it)
            heap.append((self.counters[user], self._seq[head.request_id], user))
        heapq.heapify(heap)
        slots, budget = self.ctx.max_batch_size, self.ctx.config.max_tokens_per_step
        while heap:
            counter, _, user = heapq.heappop(heap)
            req, it = heads[user]
            yield req
            if slots > 0 and budget > 0:
                service, chunk = self._step_service(req, budget)
                slots -= 1
                budget -= chunk
            else:  # past this step's batch: rank the rest by a whole step each
                service, _ = self._step_service(req, 0)
            nxt = next(it, None)
            if nxt is not None:
                heads[user] = (nxt, it)
                heapq.heappush(heap, (counter + service, self._seq[nxt.request_id], user))
