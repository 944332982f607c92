"""Async HTTP load generator for any OpenAI-compatible server (docs/DESIGN.md, "Metrics").

It replays a workload (`bench/workloads.py`) over `/v1/completions` or `/v1/chat/completions`
with `stream: true`; each request is one timed stream (`bench/request_stream.py`), and the
server's counters are differenced over the run (`bench/server_counters.py`).

- Open loop: each request is sent at its workload arrival time, whatever the server is doing.
  With `max_concurrency`, at most that many are in flight (a closed loop when every request
  arrives at t = 0); a request's latency then starts when it is actually sent.
- Multi-turn conversations: turn k+1 is sent only after turn k finished, with the real answer of
  turn k in its prompt (completions: the history as one text; chat: as messages).
- Failed requests are records too; nothing is dropped, so failures stay in every denominator.

Priority patterns (FastSwitch §4, `PriorityPattern`): each request is sent with its initial level
in the body's `priority`, and at every update point the live requests' new levels go to
`POST /v1/requests/{id}/priority` ({"priority": level}), `id` being the response id (the
`X-Request-Id` header, else the first chunk's id). HTTP has no iterations, so update points are
every period x `iteration_s` seconds: `iteration_s` is the server's decode iteration time, given or
measured as a lone request's TPOT (`measure_decode_step`). Under load iterations take longer, so
the updates then come at least once per 1/f iterations. A request that finished meanwhile answers
404: counted as `not_live`, not an error.
No torch here.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenslice.bench.client_config import CONTROL_TIMEOUT_S, ClientConfig
from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.priority_patterns import PriorityPattern, PriorityUpdates
from tokenslice.bench.request_stream import prompt_for, request_body, stream_one
from tokenslice.bench.server_counters import counter_deltas, scrape_counters
from tokenslice.bench.workloads import WorkloadRequest

# Between the turns of a conversation, in a completions prompt (chat sends messages instead).
TURN_SEPARATOR = "\n\n"


@dataclass
class RunResult:
    """One load run: the records in workload order (conversation turns after their first turn),
    counter deltas from /metrics, and when requests went out."""

    records: list[ClientRecord]
    server_counters: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    max_send_lag_s: float = 0.0  # worst delay between a request's due time and its sending
    # With a priority pattern: update points, updates accepted, requests no longer live (404), failures.
    priority_updates: dict[str, int] = field(default_factory=dict)
    wall_start: float = 0.0  # Unix time of the run's zero (to line records up with server-side step traces)


class LoadClient:
    """Replays workloads against one server; `run` may be called repeatedly (one call per rate)."""

    def __init__(self, cfg: ClientConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self._max_model_len: int | None | bool = False  # False: not asked yet

    def _http(self) -> httpx.AsyncClient:
        # No pool limit: an open-loop client must never queue requests on its own side.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))

    async def resolve_model(self, http: httpx.AsyncClient) -> str:
        if self.cfg.model:
            return self.cfg.model
        r = await http.get(self.cfg.root + "/v1/models", headers=self.cfg.headers(), timeout=CONTROL_TIMEOUT_S)
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise ValueError(f"{self.cfg.root}/v1/models lists no model; pass the model name")
        self.cfg.model = str(data[0]["id"])
        return self.cfg.model

    def server_info(self) -> dict[str, Any]:
        """What the server says about itself (/v1/models), for the results file."""
        async def get() -> dict[str, Any]:
            async with self._http() as http:
                model = await self.resolve_model(http)
                r = await http.get(self.cfg.root + "/v1/models", headers=self.cfg.headers(),
                                   timeout=CONTROL_TIMEOUT_S)
                return {"url": self.cfg.root, "model": model,
                        "models": r.json().get("data") if r.status_code == 200 else None}

        return asyncio.run(get())

    def max_model_len(self) -> int | None:
        """The served model's context as /v1/models reports it (tokenslice and vLLM do), once asked;
        None when the server does not say."""
        if self._max_model_len is False:
            info = self.server_info()
            cards = info.get("models") or []
            card = next((c for c in cards if c.get("id") == info["model"]), cards[0] if cards else {})
            value = card.get("max_model_len")
            self._max_model_len = value if isinstance(value, int) and value > 0 else None
        return self._max_model_len

    def run(self, requests: Sequence[WorkloadRequest],
            followups: Mapping[str, Sequence[WorkloadRequest]] | None = None,
            progress: Callable[[ClientRecord], None] | None = None,
            priority: PriorityPattern | None = None, iteration_s: float | None = None) -> RunResult:
        """Send `requests` at their arrival times; for a request with a conversation id, send
        the conversation's later turns (`followups[conversation_id]`) one after another. With
        `priority`, priorities follow the pattern, updated every period x `iteration_s` seconds."""
        return asyncio.run(self.run_async(requests, followups, progress, priority, iteration_s))

    async def run_async(self, requests: Sequence[WorkloadRequest],
                        followups: Mapping[str, Sequence[WorkloadRequest]] | None = None,
                        progress: Callable[[ClientRecord], None] | None = None,
                        priority: PriorityPattern | None = None, iteration_s: float | None = None) -> RunResult:
        followups = followups or {}
        gate = asyncio.Semaphore(self.cfg.max_concurrency) if self.cfg.max_concurrency else None
        chains: list[list[ClientRecord]] = []
        lag = 0.0
        if priority is not None and not (iteration_s is not None and iteration_s > 0):
            raise ValueError(f"priority updates need the server's iteration time in seconds, got {iteration_s}")
        updates = PriorityUpdates(priority) if priority is not None else None
        live: dict[str, ClientRecord] = {}  # records being streamed, by request id
        counts = dict.fromkeys(("points", "accepted", "not_live", "failed"), 0) if updates else {}
        async with self._http() as http:
            model = await self.resolve_model(http)
            before = await scrape_counters(http, self.cfg)
            t0 = time.perf_counter()
            wall_start = time.time()
            updater = None
            if updates is not None and iteration_s is not None:
                updater = asyncio.create_task(
                    self._update_priorities(http, updates, live, updates.period * iteration_s, counts))
            tasks = []
            for i, req in enumerate(sorted(requests, key=lambda r: r.arrival_time)):
                delay = req.arrival_time - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                lag = max(lag, -delay)
                turns = [req, *followups.get(req.conversation_id or "", ())] if req.conversation_id else [req]
                chain: list[ClientRecord] = []
                chains.append(chain)
                tasks.append(asyncio.create_task(self._conversation(http, model, turns, i, chain, gate, t0,
                                                                    progress, updates, live)))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
            if updater is not None:
                updater.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await updater
            after = await scrape_counters(http, self.cfg)
        return RunResult([r for chain in chains for r in chain], counter_deltas(before, after), duration, lag,
                         counts, wall_start)

    async def _update_priorities(self, http: httpx.AsyncClient, updates: PriorityUpdates,
                                 live: Mapping[str, ClientRecord], interval_s: float, counts: dict[str, int]) -> None:
        """FastSwitch §4 over HTTP: every `interval_s` (1/f iterations), new levels for the live
        requests the server has named, sent concurrently. Runs until cancelled."""
        start = time.perf_counter()
        for k in itertools.count(1):
            # An absolute schedule, so that slow rounds do not push later ones back.
            await asyncio.sleep(max(0.0, start + k * interval_s - time.perf_counter()))
            named = {rid: rec.response_id for rid, rec in live.items() if rec.response_id is not None}
            if not named:
                continue
            counts["points"] += 1
            changes = updates.at_iteration(k * updates.period, list(named))
            codes = await asyncio.gather(*(self._set_priority(http, named[rid], level)
                                           for rid, level in changes.items()))
            for code in codes:
                key = "accepted" if code == 200 else "not_live" if code == 404 else "failed"
                counts[key] += 1

    async def _set_priority(self, http: httpx.AsyncClient, response_id: str, level: int) -> int | None:
        """POST /v1/requests/{id}/priority; the HTTP status, None when the request did not get through."""
        try:
            r = await http.post(f"{self.cfg.root}/v1/requests/{response_id}/priority", json={"priority": level},
                                headers=self.cfg.headers(), timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return r.status_code

    async def _conversation(self, http: httpx.AsyncClient, model: str, turns: Sequence[WorkloadRequest],
                            index: int, out: list[ClientRecord], gate: asyncio.Semaphore | None, t0: float,
                            progress: Callable[[ClientRecord], None] | None,
                            updates: PriorityUpdates | None = None, live: dict[str, ClientRecord] | None = None
                            ) -> None:
        history: list[tuple[str, str]] = []  # (prompt, answer) of earlier turns
        for k, req in enumerate(turns):
            rid = req.request_id if k == 0 else f"{req.request_id}-turn{k}"
            rec = ClientRecord(request_id=rid, arrival=time.perf_counter() - t0, scheduled_time=req.arrival_time,
                               user=req.user, priority=req.priority, conversation_id=req.conversation_id, turn=k)
            if out and not out[-1].ok:
                # The conversation cannot go on without the answer; the turn still counts as failed.
                rec.ok, rec.error = False, "not sent: an earlier turn of its conversation failed"
                out.append(rec)
                continue
            if k > 0 and self.cfg.turn_gap_s > 0:
                await asyncio.sleep(self.cfg.turn_gap_s)
            if updates is not None:
                rec.priority = updates.initial(rec)
                req = dataclasses.replace(req, priority=rec.priority)
            first = prompt_for(req, self.cfg, index)
            prompt = self._with_history(history, first) if history else first
            body = request_body(self.cfg, model, prompt, req.output_len, self.cfg.seed + index * 1000 + k, req)
            if live is not None:
                live[rid] = rec
            if gate is not None:
                async with gate:
                    await stream_one(http, self.cfg, body, rec, t0)
            else:
                await stream_one(http, self.cfg, body, rec, t0)
            if live is not None:
                live.pop(rid, None)
            out.append(rec)
            if progress is not None:
                progress(rec)
            history.append((first if isinstance(first, str) else "", rec.text))

    def _with_history(self, history: Sequence[tuple[str, str]],
                      prompt: str | list[int]) -> str | list[int] | list[dict[str, str]]:
        text = prompt if isinstance(prompt, str) else ""
        limit = self.cfg.history_max_chars
        while history and limit is not None and sum(len(p) + len(a) for p, a in history) + len(text) > limit:
            history = history[1:]
        if self.cfg.endpoint == "chat":
            msgs = [m for p, a in history for m in ({"role": "user", "content": p},
                                                      {"role": "assistant", "content": a})]
            return [*msgs, {"role": "user", "content": text}]
        return TURN_SEPARATOR.join([s for p, a in history for s in (p, a)] + [text])

    def measure_decode_step(self, output_tokens: int = 128, prompt_tokens: int = 16, repeats: int = 3) -> float:
        """The decode iteration time a lone request sees: its TPOT (first to last token over the
        gaps between them), the median of `repeats` requests sent one after another. TPOT rather
        than the median gap, because a busy server flushes several tokens in one write and the
        gaps inside such a burst are near zero."""
        alone = LoadClient(dataclasses.replace(self.cfg, prompt_format="synthetic", max_concurrency=None))
        tpots = []
        for i in range(repeats):
            rec = alone.run([WorkloadRequest(f"calibrate-{i}", 0.0, None, prompt_tokens, output_tokens)]).records[0]
            if not rec.ok or rec.tpot is None:
                raise RuntimeError(f"calibration request failed: {rec.error}")
            tpots.append(rec.tpot)
        return sorted(tpots)[len(tpots) // 2]


__all__ = ["TURN_SEPARATOR", "RunResult", "LoadClient"]
