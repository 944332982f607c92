"""POST /v1/completions: OpenAI's legacy completions, with n, best_of, echo, logprobs and vLLM's
prompt_logprobs; streamed or not."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tokenslice.engine.protocol import EngineInfo
from tokenslice.request import RequestOutput, SamplingParams, TokenLogprobs, sampling_default
from tokenslice.server.choices import Choice, StopReasons, best_of, finish_reason, output_finish_reason
from tokenslice.server.errors import APIError
from tokenslice.server.generation_config import with_defaults
from tokenslice.server.logprobs import (TokenTexts, completion_logprobs, echo_completion_logprobs,
                                        prompt_logprob_entries)
from tokenslice.server.openapi import ok_doc
from tokenslice.server.protocol import CompletionRequest, StreamOptions
from tokenslice.server.responses import CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse
from tokenslice.server.sampling import check_logprobs, check_stream_options, sampling_params
from tokenslice.server.serving import ClientWatch, Server
from tokenslice.server.sse import sse
from tokenslice.server.streaming import StreamFormat, stream_response
from tokenslice.server.structured import structured_output
from tokenslice.server.track import Track, new_track


def add_completion_route(router: APIRouter, server: Server) -> None:
    @router.post("/completions", response_model=None, responses=ok_doc(CompletionResponse, "A completion"))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async with ClientWatch(request) as client:
            return await create_completion(server, body, request, client)


async def create_completion(server: Server, body: CompletionRequest, request: Request, client: ClientWatch
                            ) -> Response:
    track = new_track(request, "cmpl", "/v1/completions")
    server.check_model(body.model)
    check_stream_options(body)
    check_logprobs(server.settings.max_logprobs, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    body = with_defaults(body, server.settings.default_sampling)
    params, copies = completion_params(body, server.info, server.settings.default_sampling.get("max_tokens"))
    params.structured = await structured_output(body)
    prompts = _prompt_list(body.prompt)
    server.check_admission(track.tenant, len(prompts), copies)  # before any prompt is tokenized
    ids = []
    for p in prompts:
        client.check(track)
        ids.append(await run_in_threadpool(server.prompts.tokenize_prompt, p) if isinstance(p, str) else p)
    for one in ids:
        server.prompts.check_room(one, body.max_tokens, "max_tokens")
    choices = await server.submit_choices(track, ids, params, copies, body,
                                          [p if isinstance(p, str) else None for p in prompts], client)
    model, created = server.settings.served_model_name, int(time.time())
    rendering = CompletionChoices(body, prompts, TokenTexts(server.logprob_tokenizer), server.tokenizer,
                                  StopReasons.for_request(body, server.tokenizer))

    if body.stream:
        stream = CompletionStream(track, created, model, len(choices), body.stream_options, rendering)
        return stream_response(server.async_engine, track, choices, stream)

    await server.collect(choices, client, track)
    kept = best_of(choices, body.n) if copies > body.n else choices
    resp = CompletionResponse(id=track.request_id, created=created, model=model, usage=track.usage,
                              choices=[rendering.choice(k, c) for k, c in enumerate(kept)])
    track.log()
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": track.request_id})


def completion_params(body: CompletionRequest, info: EngineInfo,
                      default_max_tokens: int | None = None) -> tuple[SamplingParams, int]:
    """The engine's sampling params of every choice, and how many to generate per prompt;
    `default_max_tokens` (the generation config's) replaces the API's default of 16."""
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    copies = body.best_of or body.n
    if copies < body.n:
        raise APIError(400, f"best_of must be at least n ({body.n}), got {copies}", param="best_of")
    if body.stream and copies > body.n:
        raise APIError(400, "best_of > n cannot be streamed: the best are known only at the end", param="best_of")
    if body.stream and body.prompt_logprobs is not None and not body.echo:
        raise APIError(400, "prompt_logprobs cannot be streamed; use echo with logprobs, or stream false",
                       param="prompt_logprobs")
    # Left out, max_tokens is the default (the engine stops at the context's end); sent, it must
    # also fit the context (check_room).
    max_tokens = body.max_tokens if body.max_tokens is not None else (default_max_tokens
                                                                       or sampling_default("max_tokens"))
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 is only allowed with echo (the prompt and its logprobs)",
                       param="max_tokens")
    # best_of ranks by the sampled tokens' cumulative logprob: computed even if not asked for.
    logprobs = body.logprobs if body.logprobs is not None else (0 if copies > body.n else None)
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else (0 if max_tokens == 0 else None)
    return sampling_params(body, info, max_tokens, logprobs, prompt_logprobs), copies


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list of prompts: a string, a token-id list, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


@dataclass
class CompletionChoices:
    """Renders a request's choices as completion choices: the echoed prompt, logprobs, and
    prompt_logprobs as the request asked."""

    body: CompletionRequest
    prompts: list[str | list[int]]
    texts: TokenTexts
    tokenizer: Any
    stops: StopReasons

    def choice(self, index: int, c: Choice) -> CompletionChoice:
        body = self.body
        echo = self.echo_text(self.prompts[c.prompt_index], c.prompt_token_ids) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = (echo_completion_logprobs(self.texts, c.prompt_token_ids, c.prompt_logprobs, c.logprobs,
                                                 len(echo))
                        if body.echo else completion_logprobs(self.texts, c.prompt_token_ids[-1], c.logprobs, 0))
        prompt_lps = (prompt_logprob_entries(self.texts, c.prompt_token_ids, c.prompt_logprobs)
                      if body.prompt_logprobs is not None else None)
        return CompletionChoice(index=index, text=echo + c.text, logprobs=logprobs,
                                finish_reason=finish_reason(c.finish_reason), stop_reason=self.stops.of(c),
                                prompt_logprobs=prompt_lps)

    def echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer else ""  # accepted ids decode


class CompletionStream(StreamFormat):
    """A streamed completion: with echo, the prompt comes first (once its logprobs are in), then one
    chunk per generated token; the last token's chunk carries the finish reason."""

    chunk_model = CompletionChunk

    def __init__(self, track: Track, created: int, model: str, num_choices: int, options: StreamOptions | None,
                 rendering: CompletionChoices) -> None:
        self.rendering = rendering
        self.sent = [0] * num_choices  # characters of each choice's text sent (text_offset)
        super().__init__(track, created, model, num_choices, options)

    def render_text(self, k: int, text: str) -> str:
        return self.render(CompletionChoice(index=k, text=text))

    def event(self, k: int, text: str, finish: str | None, logprobs: CompletionLogprobs | None,
              stop_reason: int | str | None = None) -> str:
        if finish is None and logprobs is None:
            return self.text_event(k, text)
        return sse(self.render(CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=finish,
                                                stop_reason=stop_reason)))

    def events(self, k: int, choice: Choice, out: RequestOutput) -> list[str]:
        events = []
        body = self.rendering.body
        if body.echo and self.sent[k] == 0 and choice.num_output_tokens == len(out.new_token_ids):
            # The prompt first, once its logprobs are in (they come with the first output).
            echoed = self.rendering.choice(k, dataclasses.replace(choice, text="", logprobs=TokenLogprobs()))
            self.sent[k] = len(echoed.text)
            events.append(self.event(k, echoed.text, None, echoed.logprobs))
        # One chunk per generated token (as vLLM streams), even when the text is held back:
        # clients time every token and count them against usage.
        if out.text_delta or out.new_token_ids or out.finished:
            lps = None
            if body.logprobs is not None and out.logprobs is not None:
                context = choice.prompt_token_ids + choice.token_ids
                lps = completion_logprobs(self.rendering.texts, context[-len(out.new_token_ids) - 1], out.logprobs,
                                          self.sent[k])
            self.sent[k] += len(out.text_delta)
            finish = output_finish_reason(out)
            stop_reason = self.rendering.stops.of(choice) if finish else None
            events.append(self.event(k, out.text_delta, finish, lps, stop_reason))
        return events
