"""The server behind the routes: the engine client, the metrics and live state, and the
submission of an API request's choices to the engine (docs/DESIGN.md, Data flow)."""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request

from tokenslice.engine.protocol import (EngineClient, EngineDeadError, EngineFaultError, EngineOverloadedError,
                                        RequestStream)
from tokenslice.request import EngineRequest, InvalidRequestError, RequestOutput, SamplingParams
from tokenslice.server.choices import Choice, abort_unfinished, merged, sibling_seed
from tokenslice.server.errors import APIError, ClientGone, engine_fault, engine_unavailable
from tokenslice.server.identity import Tenant, TenantBook, TenantLimitError, load_keyring
from tokenslice.server.metrics import ServerMetrics
from tokenslice.server.prompts import PromptTokenizer
from tokenslice.server.protocol import SamplingFields
from tokenslice.server.settings import ServerSettings
from tokenslice.server.state import StateHub
from tokenslice.server.track import Track
from tokenslice.server.vllm_metrics import VllmMetrics


class Server:
    """What the routes share: the engine client, its tokenizer and limits, the metrics."""

    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.settings = settings
        self.async_engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        # What names tokens in logprobs; None: "token_id:<id>" (--return-tokens-as-token-ids).
        self.logprob_tokenizer = None if settings.return_tokens_as_token_ids else engine.tokenizer
        self.prompts = PromptTokenizer(engine, settings.served_model_name, settings.chat_template)
        # Who each API key is, and each tenant's live requests and limits (server/identity.py).
        self.keyring = load_keyring(settings.api_keys, settings.api_key)
        self.tenants = TenantBook()
        self.metrics = ServerMetrics(settings.served_model_name, lambda: self.async_engine.stats,
                                     lambda: self.async_engine.num_queued, tenants=self.keyring.tenant_names,
                                     replicas=getattr(engine, "replica_stats", None))
        self.vllm_metrics = VllmMetrics(self.metrics.registry, settings.served_model_name, self.info.max_model_len,
                                        lambda: self.async_engine.stats, settings.cache_config_info)
        self.async_engine.observer = self.observe
        self.state = StateHub(engine, self.metrics)

    def observe(self, out: RequestOutput) -> None:
        """Every engine output, for both sets of metrics (tokenslice's and vLLM's names)."""
        self.metrics.observe(out)
        self.vllm_metrics.observe(out)

    def check_model(self, model: str | None) -> None:
        """A request's `model` must be one of the served names: else 404, as OpenAI and vLLM answer."""
        if model is not None and model not in self.settings.model_names:
            names = ", ".join(repr(n) for n in self.settings.model_names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {names}",
                           param="model", code="model_not_found")

    async def submit(self, track: Track, request_id: str, prompt: list[int], params: SamplingParams,
                     body: SamplingFields, prefix_leader: str | None = None,
                     prompt_text: str | None = None) -> RequestStream:
        try:
            return await self.async_engine.add_request(EngineRequest(
                request_id, prompt, params, arrival_time=track.start, user=body.user, tenant=track.tenant.name,
                priority=self.priority_for(track.tenant, body.priority),
                expected_output_tokens=body.tokenslice.expected_output_tokens if body.tokenslice else None,
                delivery_rate=body.tokenslice.delivery_rate if body.tokenslice else None,
                prefix_leader=prefix_leader, prompt_text=prompt_text))
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineOverloadedError:
            raise self._overloaded(f"more than {self.settings.max_waiting} requests are waiting") from None
        except EngineDeadError:
            raise engine_unavailable(self.settings.retry_after_s) from None
        except EngineFaultError as e:
            raise engine_fault(track.request_id, e) from None

    def priority_for(self, tenant: Tenant, priority: int) -> int:
        """The priority a tenant's request gets: clamped into its key's range (server/identity.py)
        under a policy that reads priorities; others refuse any but 0, so it is left as asked."""
        return tenant.clamp(priority) if self.info.uses_priority else priority

    def check_admission(self, tenant: Tenant, num_prompts: int, copies: int) -> None:
        """Refuse, before any prompt is tokenized or admitted, a request whose engine requests
        (prompts x copies) could not all be taken: past --max-prompts-per-request or --max-waiting
        (400: it never fits), past the room left under --max-waiting or the tenant's in-flight
        limit (429: it may fit later)."""
        settings = self.settings
        if num_prompts > settings.max_prompts_per_request:
            raise APIError(400, f"{num_prompts} prompts in one request; this server takes at most "
                                f"{settings.max_prompts_per_request} (--max-prompts-per-request)", param="prompt")
        n = num_prompts * copies
        if n > settings.max_waiting:
            raise APIError(400, f"this request makes {n} engine requests ({num_prompts} prompt(s) x {copies} "
                                f"choice(s)); at most {settings.max_waiting} may wait at once (--max-waiting)",
                           param="prompt" if num_prompts > 1 else "n")
        waiting = self.async_engine.num_queued
        if waiting + n > settings.max_waiting:
            raise self._overloaded(f"{waiting} requests are waiting and this one adds {n}; at most "
                                   f"{settings.max_waiting} may wait")
        try:
            self.tenants.check(tenant, n, 0)
        except TenantLimitError as e:
            raise self._tenant_limited(tenant, e) from None

    def _overloaded(self, detail: str) -> APIError:
        """The 429 of a full waiting queue (--max-waiting)."""
        return APIError(429, f"server overloaded: {detail}; retry later", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": str(self.settings.retry_after_s)})

    def _tenant_limited(self, tenant: Tenant, e: TenantLimitError) -> APIError:
        self.metrics.tenant_limited(tenant.name, e.limit)
        return APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None)

    async def submit_choices(self, track: Track, prompts: list[list[int]], params: SamplingParams, copies: int,
                             body: SamplingFields, texts: list[str | None] | None = None,
                             client: ClientWatch | None = None) -> list[Choice]:
        """`copies` engine requests per prompt, each its own scheduled request: the request id for
        a single one, `{id}-{k}` (k = prompt index x copies + i) for several. All or none, and
        within the tenant's limits (429 past them). `texts`: each prompt in the client's words.
        If the `client` leaves meanwhile, what was submitted is aborted and the rest never is."""
        self.check_admission(track.tenant, len(prompts), copies)
        track.prompt_tokens = sum(len(p) for p in prompts)  # streamed usage may be sent before any output
        single = len(prompts) * copies == 1
        choices: list[Choice] = []
        # As OpenAI's rate limits count: the prompt and max_tokens of every choice, at admission.
        tokens = track.prompt_tokens + params.max_tokens * len(prompts) * copies
        try:
            with self.tenants.admit(track.tenant, len(prompts) * copies, tokens) as accepted:
                for pi, ids in enumerate(prompts):
                    for i in range(copies):
                        if client is not None:
                            client.check(track)
                        rid = track.request_id if single else f"{track.request_id}-{pi * copies + i}"
                        sp = dataclasses.replace(params, seed=sibling_seed(params.seed, i))
                        # Siblings start from the first one's prompt KV (prefix cache) instead of recomputing it.
                        leader = choices[pi * copies].stream.request_id if i else None
                        text = texts[pi] if texts is not None else None
                        choices.append(Choice(pi, ids, await self.submit(track, rid, ids, sp, body, leader, text)))
                        accepted(choices[-1].stream)
        except TenantLimitError as e:
            raise self._tenant_limited(track.tenant, e) from None
        except BaseException:
            abort_unfinished(self.async_engine, choices)
            raise
        return choices

    async def collect(self, choices: list[Choice], client: ClientWatch, track: Track) -> None:
        """Run non-streamed choices to their end; abort them all if the client disconnects first."""
        async def consume() -> None:
            async for k, out in merged(choices):
                choices[k].add(out)
                track.account(choices)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(client.gone.wait())
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                abort_unfinished(self.async_engine, choices)
        if consumer not in done:
            client.check(track)
        try:
            consumer.result()
        except (EngineFaultError, EngineDeadError) as e:
            raise engine_fault(track.request_id, e) from None


class ClientWatch:
    """Notices the client's disconnect from the moment its body is read, for the whole handler
    (`async with`): while its prompts are tokenized and submitted, and while a non-streamed
    answer is computed. (A streamed answer's own response notices it after the handler.)"""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.gone = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ClientWatch:
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        # The body was read already, so the next message the server delivers is the disconnect.
        while True:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                self.gone.set()
                return

    def check(self, track: Track) -> None:
        """Raise ClientGone (logging the request as aborted) if the client has left."""
        if self.gone.is_set():
            track.outcome = "client disconnected; aborted"
            track.log()
            raise ClientGone()
