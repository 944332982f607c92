"""Fairness policies (FastSwitch's setting): `priority`, an external priority that may change
while a request lives, and `vtc`, the Virtual Token Counter's fair share (Sheng et al., OSDI'24
"Fairness in Serving Large Language Models"), per tenant and, within a tenant, per user."""
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


class _Ledger:
    """One level of VTC's counters (tenants, or one tenant's users): each member's service so far,
    divided by its share, and the set of active members (with live requests)."""

    def __init__(self, shares: dict[str, float]) -> None:
        self.shares = shares
        self.counters: dict[str | None, float] = {}
        self.active: set[str | None] = set()

    def share(self, member: str | None) -> float:
        return self.shares.get(member, 1.0) if member is not None else 1.0

    def join(self, member: str | None) -> None:
        """`member` becomes active: lifted to the least active counter (VTC §4.1: idling banks no credit)."""
        own = self.counters.get(member, 0.0)
        self.counters[member] = max(own, min(self.counters[m] for m in self.active)) if self.active else own
        self.active.add(member)

    def leave(self, member: str | None) -> None:
        self.active.discard(member)
        if not self.active:
            # Idle: everyone got what they asked for, so nobody's past service counts against
            # them any more (as virtual time restarts in fair queueing); also bounds the table.
            self.counters.clear()
        elif self.counters[member] <= min(self.counters[m] for m in self.active):
            # The least active counter never falls while anyone is active, so a return would
            # lift this member at least to where it is: forgetting it changes nothing.
            del self.counters[member]

    def charge(self, member: str | None, input_service: float, output_unit: float, outputs: int) -> None:
        share = self.share(member)
        c = self.counters[member]
        if input_service:
            c += input_service / share
        unit = output_unit / share
        # One addition per token, so a run of steps charged at once (fast-forward) adds exactly
        # what step-by-step charging adds.
        for _ in range(outputs):
            c += unit
        self.counters[member] = c


class VTCPolicy(Policy):
    """Virtual Token Counter (Sheng et al. §4, Algorithm 2), preemptive at token granularity, in
    two levels: tenants (`serve --api-keys`), then each tenant's users (the OpenAI `user`).

    Each tenant has a counter of the service it received: input tokens x w_in + output tokens x
    w_out, divided by its weight (tenant_weights); within a tenant, each user has one too, divided
    by its share (vtc_weights). The ranking repeats VTC's selection loop at both levels: the tenant
    with the least counter, then its user with the least counter, then that user's next request
    (arrival order); the service that request would get in this step is added to copies of both
    counters, and the loop picks again. So a tenant's share of the batch does not grow with the
    number of `user` values it sends: those only divide its own share (hierarchical fair
    queueing). Without tenants (every request's tenant is None) this is the paper's per-user VTC.
    A member that becomes active is lifted to the least counter among active members at its
    level (§4.1: idling banks no credit). Recomputing dropped KV is the server's overhead and
    charges nothing: only first-time prompt tokens and sampled tokens count, as in the paper's
    definition of service.

    Fairness (§4.2, Theorem 4.4's setting): with two users that each keep at least max_batch_size
    live requests, memory ample and max_tokens_per_step covering the batch's chunks, the batch is
    exactly the selection loop's, so their counters never differ by more than one request's
    service in one step, and their services over any interval by at most twice that
    (tests/test_fair.py checks it); the same holds between tenants."""

    name = "vtc"

    def __init__(self, ctx: PolicyContext) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.w_in = cfg.vtc_input_weight
        self.w_out = cfg.vtc_output_weight
        self.user_shares = parse_vtc_weights(cfg.vtc_weights)
        self.tenants = _Ledger(parse_vtc_weights(cfg.tenant_weights, "tenant_weights"))
        self.users: dict[str | None, _Ledger] = {}  # per tenant with live requests
        # Per active tenant, per active user, its live requests in arrival order.
        self._live: dict[str | None, dict[str | None, dict[str, Request]]] = {}
        self._seq: dict[str, int] = {}
        self._order = itertools.count()
        # Service already charged per request: prompt tokens (high-water mark) and output tokens.
        self._charged: dict[str, tuple[int, int]] = {}

    @property
    def counters(self) -> dict[str | None, float]:
        """The users' counters of the requests without a tenant (all of them without --api-keys)."""
        ledger = self.users.get(None)
        return ledger.counters if ledger is not None else {}

    def share(self, user: str | None) -> float:
        return self.user_shares.get(user, 1.0) if user is not None else 1.0

    # ---- membership ---------------------------------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        tenant, user = req.tenant, req.user
        users = self._live.get(tenant)
        if users is None:
            self.tenants.join(tenant)
            users = self._live[tenant] = {}
            self.users.setdefault(tenant, _Ledger(self.user_shares))
        queue = users.get(user)
        if queue is None:
            self.users[tenant].join(user)
            queue = users[user] = {}
        queue[req.request_id] = req
        self._seq[req.request_id] = next(self._order)
        self._charged[req.request_id] = (0, 0)

    def on_finish(self, req: Request) -> None:
        rid, tenant, user = req.request_id, req.tenant, req.user
        if rid not in self._charged:
            return
        self._charge(req)  # the finishing step's service: update() finishes before on_step
        del self._charged[rid], self._seq[rid]
        users = self._live[tenant]
        queue = users[user]
        del queue[rid]
        if queue:
            return
        del users[user]
        self.users[tenant].leave(user)
        if users:
            return
        del self._live[tenant], self.users[tenant]  # its users' counters restart with it
        self.tenants.leave(tenant)

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
        input_service = self.w_in * new_in
        self.tenants.charge(req.tenant, input_service, self.w_out, new_out)
        self.users[req.tenant].charge(req.user, input_service, self.w_out, new_out)

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        for req in ran:
            if req.request_id in self._charged:
                self._charge(req)

    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        """Counters move every step, but when the batch holds every live request the batch
        cannot change before an arrival or a finish (which end a fast-forward anyway); otherwise
        no bound is computed and nothing repeats."""
        return len(ends) if len(ran) == len(self._seq) else 1

    def describe_queues(self) -> dict[str, Any]:
        """Active tenants, least counter (next served) first, and within each its active users,
        least counter first, each with its requests in arrival order. `users` lists the users of
        every tenant in that order, each naming its tenant."""
        tenants = sorted(self._live, key=lambda t: self.tenants.counters[t])
        users = []
        for t in tenants:
            ledger = self.users[t]
            for u in sorted(self._live[t], key=lambda u: ledger.counters[u]):
                users.append({"user": u, "tenant": t, "counter": ledger.counters[u], "share": ledger.share(u),
                              "requests": list(self._live[t][u])})
        return {"kind": "vtc", "users": users,
                "tenants": [{"tenant": t, "counter": self.tenants.counters[t], "share": self.tenants.share(t)}
                            for t in tenants]}

    # ---- order --------------------------------------------------------------------------------
    def _step_service(self, req: Request, budget: int) -> tuple[float, int]:
        """Service (weighted tokens, before any share) `req` would be charged for running next
        with `budget` step tokens left (the scheduler's chunking), and the tokens it would take."""
        computed = req.num_computed_tokens
        left = req.num_tokens - computed
        chunk = min(left, budget) if budget > 0 else left
        prompt_done = self._charged[req.request_id][0]
        new_in = min(computed + chunk, req.num_prompt_tokens) - prompt_done
        service = self.w_in * new_in if new_in > 0 else 0.0
        if chunk == left:  # the chunk reaches the end: it samples a token
            service += self.w_out
        return service, chunk

    def ranked(self, now: float) -> Iterator[Request]:
        # Per tenant: its users' heap of (counter, next request's arrival, user) and their next requests.
        inner: dict[str | None, tuple[list[tuple[float, int, str | None]],
                                      dict[str | None, tuple[Request, Iterator[Request]]]]] = {}
        outer: list[tuple[float, int, str | None]] = []
        for tenant, users in self._live.items():
            heap: list[tuple[float, int, str | None]] = []
            heads: dict[str | None, tuple[Request, Iterator[Request]]] = {}
            counters = self.users[tenant].counters
            for user, queue in users.items():
                it = iter(queue.values())
                head = next(it)
                heads[user] = (head, it)
                heap.append((counters[user], self._seq[head.request_id], user))
            heapq.heapify(heap)
            inner[tenant] = (heap, heads)
            outer.append((self.tenants.counters[tenant], heap[0][1], tenant))
        heapq.heapify(outer)
        slots, budget = self.ctx.max_batch_size, self.ctx.config.max_tokens_per_step
        while outer:
            tenant_counter, _, tenant = heapq.heappop(outer)
            heap, heads = inner[tenant]
            user_counter, _, user = heapq.heappop(heap)
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
                heapq.heappush(heap, (user_counter + service / self.share(user), self._seq[nxt.request_id], user))
            if heap:
                heapq.heappush(outer, (tenant_counter + service / self.tenants.share(tenant), heap[0][1], tenant))
