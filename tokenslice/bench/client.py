"""Async HTTP load generator for any OpenAI-compatible server (docs/DESIGN.md, "Metrics").

It replays a workload (`bench/workloads.py`) over `/v1/completions` or `/v1/chat/completions`
with `stream: true`, and times every token as the client sees it: the request is stamped when it
is sent, each streamed chunk that carries a token when it is parsed, the end when the chunk with
`finish_reason` arrives. All stamps come from one monotonic clock (`time.perf_counter`), taken
relative to the start of the run.

- Open loop: each request is sent at its workload arrival time, whatever the server is doing.
  With `max_concurrency`, at most that many are in flight (a closed loop when every request
  arrives at t = 0); a request's latency then starts when it is actually sent.
- Output lengths follow the workload: `max_tokens` = its output length, plus `ignore_eos` (an
  extension tokenslice and vLLM accept) so that the model cannot stop early. For tokenslice's
  `srpt-oracle` the true length can go along as `tokenslice.expected_output_tokens`.
- Multi-turn conversations: turn k+1 is sent only after turn k finished, with the real answer of
  turn k in its prompt (completions: the history as one text; chat: as messages).
- A request that gets an HTTP error, an error event, an incomplete stream or times out is a
  failed record; nothing is dropped, so failures stay in every denominator.

Token counting: the server's `usage.completion_tokens` (requested with
`stream_options.include_usage`) when it reports it, else the number of token chunks. tokenslice
and vLLM send one chunk per token; a server that merges tokens into one chunk gives fewer chunk
timestamps than tokens, and TBT is then measured between chunks (`chunks` records how many).

Server counters: `/metrics` is scraped before and after a run; the difference of every counter
(and histogram `_sum` / `_count`) with the given prefix is kept, whatever the server exposes.

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
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenslice.bench.metrics import COUNTER_KEYS, RequestRecord
from tokenslice.bench.workloads import PriorityPattern, PriorityUpdates, WorkloadRequest

ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("auto", "synthetic")
# Synthetic prompt ids stay in this range: below every real vocabulary size (builtin:tiny has 259).
SYNTHETIC_ID_LOW, SYNTHETIC_ID_SPAN = 100, 100
# Between the turns of a conversation, in a completions prompt (chat sends messages instead).
TURN_SEPARATOR = "\n\n"


@dataclass
class ClientConfig:
    """How to talk to the server; `base_url` with or without the trailing /v1."""

    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    endpoint: str = "completions"
    ignore_eos: bool = True
    send_expected_length: bool = False  # tokenslice extension read by srpt-oracle
    temperature: float = 0.0
    seed: int = 0  # request i is sent with seed + i, so its tokens do not depend on the batch
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    prompt_format: str = "auto"  # auto: workload text, else its ids, else synthetic ids; synthetic: always ids
    metrics_prefix: str = "tokenslice:"
    turn_gap_s: float = 0.0  # user think time between a conversation's turns
    history_max_chars: int | None = None  # drop a conversation's oldest turns past this (model context)

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class ClientRecord(RequestRecord):
    """A RequestRecord plus what only the client knows. Times are seconds from the run start."""

    scheduled_time: float = 0.0  # the workload's arrival time (arrival is when it was sent)
    chunks: int = 0  # token chunks received
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    conversation_id: str | None = None
    turn: int = 0
    text: str = ""  # the streamed answer (the next turn's history needs it)
    response_id: str | None = None  # the server's id (cmpl-...), for priority updates


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


# ---------------------------------------------------------------- requests and streams

def synthetic_prompt_ids(length: int, salt: int) -> list[int]:
    """`length` token ids valid in any vocabulary of 200+ tokens; varied so no prefix is shared."""
    return [SYNTHETIC_ID_LOW + (salt * 7 + 13 * j) % SYNTHETIC_ID_SPAN for j in range(max(1, length))]


def prompt_for(req: WorkloadRequest, cfg: ClientConfig, index: int) -> str | list[int]:
    if cfg.prompt_format == "auto":
        if req.prompt is not None:
            return req.prompt
        if req.prompt_token_ids:
            return list(req.prompt_token_ids)
    return synthetic_prompt_ids(req.prompt_len, index)


def request_body(cfg: ClientConfig, model: str, prompt: str | list[int] | list[dict[str, str]], max_tokens: int,
                 seed: int, req: WorkloadRequest) -> dict[str, Any]:
    """The JSON body: `prompt` for completions, `messages` (a list of dicts) for chat."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": cfg.temperature, "seed": seed}
    if cfg.endpoint == "chat":
        body["messages"] = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else [
            {"role": "user", "content": prompt if isinstance(prompt, str) else ""}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.send_expected_length:
        body["tokenslice"] = {"expected_output_tokens": max_tokens}
    if req.user is not None:
        body["user"] = req.user
    if req.priority is not None:
        body["priority"] = req.priority
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {msg}"


def _token_delta(chunk: Mapping[str, Any], endpoint: str) -> tuple[str | None, str | None]:
    """(text of the token this chunk carries or None if it carries none, finish_reason)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None, None  # the usage chunk
    choice = choices[0]
    finish = choice.get("finish_reason")
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        # The opening chunk announces the role with "" content and carries no token.
        content = delta.get("content") if delta.get("role") is None else (delta.get("content") or None)
        return content, finish
    return choice.get("text"), finish


async def stream_one(http: httpx.AsyncClient, cfg: ClientConfig, body: dict[str, Any], record: ClientRecord,
                     t0: float) -> None:
    """Send one streamed request and fill `record` (ok, or failed with `error`)."""
    url = cfg.root + ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions")
    parts: list[str] = []
    record.ok = False
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            record.arrival = time.perf_counter() - t0
            async with http.stream("POST", url, json=body, headers=cfg.headers()) as resp:
                if resp.status_code != 200:
                    record.error = _error_text(resp.status_code, await resp.aread())
                    return
                record.response_id = resp.headers.get("x-request-id")
                done = False
                async for line in resp.aiter_lines():
                    now = time.perf_counter() - t0
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"error event: {(chunk['error'] or {}).get('message')}"
                        return
                    if record.response_id is None and chunk.get("id"):
                        record.response_id = str(chunk["id"])
                    if chunk.get("usage"):
                        record.usage_completion_tokens = chunk["usage"].get("completion_tokens")
                        record.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
                    text, finish = _token_delta(chunk, cfg.endpoint)
                    if text is not None:
                        record.token_times.append(now)
                        parts.append(text)
                    if finish is not None:
                        record.finish_reason = finish
                        record.finish_time = now
                if not done or record.finish_reason is None:
                    record.error = "stream ended before its finish_reason and [DONE]"
                    record.finish_time = None
                    return
    except TimeoutError:
        record.error = f"timeout after {cfg.request_timeout_s:g} s"
        record.finish_time = None
        return
    except (httpx.HTTPError, OSError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
        record.finish_time = None
        return
    record.ok = True
    record.text = "".join(parts)
    record.chunks = len(record.token_times)
    record.first_token_time = record.token_times[0] if record.token_times else None
    record.output_tokens = (record.usage_completion_tokens if record.usage_completion_tokens is not None
                            else record.chunks)
    record.prompt_tokens = record.usage_prompt_tokens or 0


# ---------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, prefix: str) -> dict[str, float]:
    """Counters (`*_total`) and histogram `_sum` / `_count` samples whose name starts with
    `prefix`, summed over labels; also `name{labels}` for labelled samples. Gauges and
    `_created` timestamps are left out: only what accumulates can be differenced."""
    kinds: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind.strip()
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith(prefix):
            continue
        name, labels, value = m.groups()
        family = next((name[:-len(s)] for s in ("_total", "_sum", "_count") if name.endswith(s)), None)
        # Exposition formats differ on whether the TYPE line names the family or the sample.
        if family is None or (kinds.get(family) or kinds.get(name)) not in ("counter", "histogram", "summary"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if labels:
            out[name + labels] = v
        out[name] = out.get(name, 0.0) + v
    return out


async def scrape_counters(http: httpx.AsyncClient, cfg: ClientConfig) -> dict[str, float] | None:
    """The server's counters, or None when it has no Prometheus /metrics."""
    try:
        r = await http.get(cfg.root + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_counters(r.text, cfg.metrics_prefix) if r.status_code == 200 else None


def counter_deltas(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float]:
    if before is None or after is None:
        return {}
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def counters_as_metrics(deltas: Mapping[str, float], prefix: str = "tokenslice:") -> dict[str, float]:
    """Results-file counter keys (COUNTER_KEYS) from scraped deltas, matched by name:
    `tokenslice:num_preemptions_total` -> preemptions, `tokenslice:kv_swap_in_bytes_total` ->
    swap_in_bytes, and so on for whatever counters the server adds; plus the server's mean queue
    time (arrival to first scheduled) from its histogram."""
    out: dict[str, float] = {}
    for name, value in deltas.items():
        if "{" in name or not name.startswith(prefix) or not name.endswith("_total"):
            continue
        base = name[len(prefix):-len("_total")]
        for candidate in (base, base.removeprefix("num_"), base.removeprefix("kv_")):
            if candidate in COUNTER_KEYS:
                out[candidate] = value
    qsum, qcount = deltas.get(prefix + "request_queue_time_seconds_sum"), deltas.get(
        prefix + "request_queue_time_seconds_count")
    if qsum is not None and qcount:
        out["server_mean_queue_s"] = qsum / qcount
    return out


# ---------------------------------------------------------------- the load generator

class LoadClient:
    """Replays workloads against one server; `run` may be called repeatedly (one call per rate)."""

    def __init__(self, cfg: ClientConfig) -> None:
        cfg.validate()
        self.cfg = cfg

    def _http(self) -> httpx.AsyncClient:
        # No pool limit: an open-loop client must never queue requests on its own side.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))

    async def resolve_model(self, http: httpx.AsyncClient) -> str:
        if self.cfg.model:
            return self.cfg.model
        r = await http.get(self.cfg.root + "/v1/models", headers=self.cfg.headers(), timeout=30)
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
                r = await http.get(self.cfg.root + "/v1/models", headers=self.cfg.headers(), timeout=30)
                return {"url": self.cfg.root, "model": model,
                        "models": r.json().get("data") if r.status_code == 200 else None}

        return asyncio.run(get())

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
                                headers=self.cfg.headers(), timeout=30)
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


def wait_idle(cfg: ClientConfig, timeout_s: float = 120.0) -> bool:
    """Wait until a tokenslice server reports no live request (after a run whose clients timed
    out, the server may still be finishing their aborts). False if it never did or cannot say."""
    deadline = time.monotonic() + timeout_s
    gauges = ("num_requests_running", "num_requests_waiting", "num_requests_preempted")
    while time.monotonic() < deadline:
        try:
            text = httpx.get(cfg.root + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return False
        values = [float(m.group(3)) for line in text.splitlines()
                  if (m := _SAMPLE.match(line)) and any(m.group(1) == cfg.metrics_prefix + g for g in gauges)]
        if not values:
            return False
        if all(v == 0 for v in values):
            return True
        time.sleep(0.1)
    return False


__all__ = ["ENDPOINTS", "PROMPT_FORMATS", "ClientConfig", "ClientRecord", "RunResult", "LoadClient",
           "synthetic_prompt_ids", "prompt_for", "request_body", "stream_one", "parse_counters", "scrape_counters",
           "counter_deltas", "counters_as_metrics", "wait_idle"]
