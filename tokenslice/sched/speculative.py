"""`srpt-predicted`: ALISE's speculative shortest-remaining-time scheduler (ALISE §3.1-3.2).

Each request gets a predicted output length at arrival (`Request.predicted_output_tokens`, filled
by the engine's LengthPredictor or the simulator; without one, the mean output of the requests
finished so far). The execution-time model turns it into seconds (ALISE Eqs. 3-5):

    T(I, O) = prefill(I) + sum_{c=I+1}^{I+O-1} decode(c)

(the prefill samples the first token; each later token is one decode step at the context it
attends). Jobs run in order of estimated remaining time, with virtual aging so none waits
forever, and a job that outlives its prediction has it doubled (demotion). `next_run_estimates`
is ALISE's estimated waiting time (EWT, §3.2), which orders swaps.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from tokenslice.request import Request, RequestState
from tokenslice.sched.policy import Policy, PolicyContext, SortedKeys, queue_position_estimates

# Predicted output tokens of a request without a prediction, until a request has finished; then
# the running mean of finished requests' outputs takes over.
DEFAULT_OUTPUT_TOKENS = 128

# (virtual priority, arrival, arrival order, id): the ranking, smallest first.
_Key = tuple[float, float, int, str]


class SpeculativeSRPTPolicy(Policy):
    """Shortest estimated remaining execution time first, with virtual aging (ALISE §3.1).

    Aging: effective priority = T_rem - aging x (now - arrival). Every waiting job ages at the
    same rate, so the order is that of T_rem + aging x arrival, which does not move with the clock:
    a key changes only when its job runs, and re-keying the batch after each iteration keeps the
    ranking current. Time since arrival, not since the last run: a long job that aged past a
    stream of short ones keeps its place until it finishes, instead of running one token and
    waiting the whole aging period again. A job waits at most about T_rem / aging before every
    later arrival ranks behind it.

    Misprediction (ALISE §3.1): a job still running when its output reaches the prediction has
    the prediction doubled (as often as needed), so its remaining time and priority drop back.
    """

    name = "srpt-predicted"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.aging = ctx.config.srpt_aging
        self._live: dict[str, Request] = {}
        self.predicted: dict[str, int] = {}  # current predicted output tokens, after demotions
        self._rem: dict[str, float] = {}  # T_rem at the job's current key
        self._keys = SortedKeys()  # the ranking
        self._order = itertools.count()
        self._epoch: float | None = None  # first arrival: keeps aged keys small and precise
        self._finished_tokens = 0
        self._finished_count = 0
        self.num_demotions = 0
        # Ranks instead of this policy while its length predictor still learns (start_warmup);
        # it sees every event, so the switch finds both rankings current.
        self.warmup: Policy | None = None

    def start_warmup(self, ranking: Policy) -> None:
        """Rank by `ranking` (skip-join-mlfq) until end_warmup: the self length head that serves the
        predictions has not seen enough answers yet (predict/self_head.py min_answers)."""
        self.warmup = ranking

    def end_warmup(self) -> None:
        self.warmup = None

    # ---- execution-time model (ALISE Eqs. 3-5) ----------------------------------------------
    def decode_sum_s(self, start_context: int, steps: int) -> float:
        """Decode seconds of `steps` iterations attending start_context, start_context + 1, ...
        Trapezoid over the first and last step: exact when a step's time is linear in its
        context, as it is for both cost models (roofline and fitted profile) at batch 1; two
        memoized look-ups instead of one per token."""
        if steps <= 0:
            return 0.0
        d = self.ctx.decode_s
        return steps * (d(start_context) + d(start_context + steps - 1)) / 2

    def execution_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """T(I, O): the whole job from scratch."""
        return self.ctx.first_iteration_s(prompt_tokens) + self.decode_sum_s(prompt_tokens + 1, output_tokens - 1)

    def remaining_s(self, req: Request) -> float:
        """T_rem: the prefill if the job has not produced a token yet, plus the decode steps from
        its current length to its predicted end. A job whose KV was dropped owes a recompute, but
        that is the server's doing: counting it would sink the job for being preempted."""
        total = self.predicted.get(req.request_id, 1)
        done = req.num_output_tokens
        if done == 0:
            return self.execution_s(req.num_prompt_tokens, total)
        return self._decode_left_s(req.num_prompt_tokens, done, total)

    def _decode_left_s(self, prompt_tokens: int, done: int, predicted: int) -> float:
        """T_rem of a decoding job: its steps from the current length to the predicted end."""
        return self.decode_sum_s(prompt_tokens + done, predicted - done)

    # ---- predictions ------------------------------------------------------------------------
    def _cap(self, req: Request) -> int:
        """Most output tokens the job can produce: a prediction past it is known to be wrong."""
        cap = req.params.max_tokens
        if req.max_total_tokens is not None:
            cap = min(cap, req.max_total_tokens - req.num_prompt_tokens)
        return max(1, cap)

    def fallback_output_tokens(self) -> float:
        """Prediction for a request that came without one: mean output so far."""
        if self._finished_count == 0:
            return DEFAULT_OUTPUT_TOKENS
        return self._finished_tokens / self._finished_count

    def _demote(self, req: Request) -> None:
        """ALISE §3.1 misprediction handling: the job outlived its prediction, so double it until
        it lies ahead again (never past what the job can produce)."""
        rid = req.request_id
        self.predicted[rid], doublings = self._doubled(self.predicted[rid], self._cap(req), req.num_output_tokens)
        self.num_demotions += doublings

    @staticmethod
    def _doubled(predicted: int, cap: int, done: int) -> tuple[int, int]:
        """The prediction doubled until it lies ahead of `done` (at most `cap`), and how often."""
        n = 0
        while done >= predicted and predicted < cap:
            predicted = min(2 * predicted, cap)
            n += 1
        return predicted, n

    # ---- ranking ------------------------------------------------------------------------------
    def _aging_offset(self, req: Request) -> float:
        """aging x arrival: the clock-free part of -aging x (now - arrival)."""
        return self.aging * (req.arrival_time - (self._epoch or 0.0))

    def _key(self, req: Request) -> tuple[_Key, float]:
        rem = self.remaining_s(req)
        old = self._keys.get(req.request_id)
        seq = old[2] if old is not None else next(self._order)
        return (rem + self._aging_offset(req), req.arrival_time, seq, req.request_id), rem

    def _rekey(self, req: Request) -> None:
        rid = req.request_id
        key, rem = self._key(req)
        self._rem[rid] = rem
        self._keys.put(rid, key)

    # ---- Policy protocol ------------------------------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        if self._epoch is None:
            self._epoch = req.arrival_time
        rid = req.request_id
        guess = req.predicted_output_tokens
        if guess is None:
            guess = self.fallback_output_tokens()
        self._live[rid] = req
        self.predicted[rid] = min(max(1, round(guess)), self._cap(req))
        self._rekey(req)
        if self.warmup is not None:
            self.warmup.on_arrival(req, now)

    def on_prediction(self, req: Request, now: float) -> None:
        """The length predictor refined `req`'s predicted output (from the model's own hidden
        state, at the end of prefill or while it decodes): rank it by the new remaining time."""
        rid = req.request_id
        if rid in self._live and req.predicted_output_tokens is not None:
            done = req.num_output_tokens
            self.predicted[rid] = min(max(done + 1, req.predicted_output_tokens), self._cap(req))
            self._rekey(req)

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        # Only jobs that ran changed (ALISE re-evaluates priorities every iteration; waiting
        # jobs' aged keys are constant, see the class doc).
        self._charge(ran)
        if self.warmup is not None:
            self.warmup.on_step(ran, step_seconds, now)

    def _charge(self, ran: list[Request]) -> None:
        for req in ran:
            if req.request_id in self._live:
                self._demote(req)
                self._rekey(req)

    def on_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> None:
        """Charge a run of decode steps at once: keys and predictions depend only on a job's
        tokens, so the end state is what step-by-step charging reaches."""
        self._charge(ran)
        if self.warmup is not None:
            self.warmup.on_steps(ran, durations, ends)

    def on_priority_change(self, req: Request, old_priority: int, now: float) -> None:
        if self.warmup is not None:
            self.warmup.on_priority_change(req, old_priority, now)

    def stable_steps(self, ran: list[Request], durations: list[float], ends: list[float]) -> int:
        """Steps the batch may repeat before a batch job falls behind a job outside the batch it
        was ahead of (only a demotion can do that: otherwise remaining time only shrinks). A
        change at the end of step j allows j + 1 steps."""
        if self.warmup is not None:
            return self.warmup.stable_steps(ran, durations, ends)
        limit = len(ends)
        batch = {r.request_id for r in ran}
        best_other = next((k for k in self._keys if k[3] not in batch), None)
        if best_other is None:
            return limit
        for req in ran:
            rid = req.request_id
            if rid not in self._live:
                continue
            start = self._keys.get(rid)
            p, cap = self.predicted[rid], self._cap(req)
            prompt, done, aged = req.num_prompt_tokens, req.num_output_tokens, self._aging_offset(req)
            for j in range(limit):
                out = done + j + 1
                p, _ = self._doubled(p, cap, out)  # the demotion at the end of step j
                # The key it then has (decoding: no prefill left).
                key = (self._decode_left_s(prompt, out, p) + aged,) + start[1:]
                if key > start and key > best_other:
                    limit = j + 1
                    break
        return max(1, limit)

    def on_finish(self, req: Request) -> None:
        if self.warmup is not None:
            self.warmup.on_finish(req)
        rid = req.request_id
        if self._live.pop(rid, None) is None:
            return
        self._keys.pop(rid)
        self.predicted.pop(rid, None)
        self._rem.pop(rid, None)
        if req.state is RequestState.FINISHED:  # an abort's length says nothing about outputs
            self._finished_tokens += req.num_output_tokens
            self._finished_count += 1

    def ranked(self, now: float) -> Iterable[Request]:
        if self.warmup is not None:
            return self.warmup.ranked(now)
        return (self._live[k[3]] for k in self._keys)

    def top_queue_jobs(self, k: int) -> Iterable[Request]:
        return self.warmup.top_queue_jobs(k) if self.warmup is not None else ()

    def describe_queues(self) -> dict[str, Any]:
        """Jobs by aged estimated remaining time, with their current predictions (ALISE §3.1);
        while the length head learns, the ranking in use (skip-join-mlfq's queues)."""
        if self.warmup is not None:
            return {**self.warmup.describe_queues(), "warmup_for": self.name}
        return {"kind": "srpt", "aging": self.aging,
                "order": [{"id": k[3], "predicted_output_tokens": self.predicted[k[3]],
                           "predicted_remaining_tokens": self.predicted[k[3]] - self._live[k[3]].num_output_tokens,
                           "remaining_s": self._rem[k[3]]} for k in self._keys]}

    # ---- swap ordering and memory hints (ALISE §3.2) ------------------------------------------
    def next_run_estimates(self, now: float) -> dict[str, float]:
        """ALISE EWT (§3.2, Eqs. 6-7): a job waits for the remaining execution time of the jobs
        ranked ahead of it, shared max_batch_size ways; the batch runs now."""
        if self.warmup is not None:
            return self.warmup.next_run_estimates(now)
        ranked = list(self.ranked(now))
        return queue_position_estimates(ranked, self._rem, self.ctx.max_batch_size)

    def device_job_limit(self, capacity_tokens: int, now: float) -> int:
        """ALISE Algorithm 2's device job limit: how many of the top-ranked jobs the device can
        keep until they finish, by predicted peak KV (prompt + predicted output). proactive-swap
        uploads only jobs within it (Scheduler._within_device_job_limit); the rest wait on host,
        and offloads take the largest EWT first. At least one, so the head always fits alone."""
        if self.warmup is not None:
            return self.warmup.device_job_limit(capacity_tokens, now)
        used, n = 0, 0
        for k in self._keys:
            req = self._live[k[3]]
            used += req.num_prompt_tokens + self.predicted[k[3]]
            if used > capacity_tokens:
                break
            n += 1
        return max(1, n)
