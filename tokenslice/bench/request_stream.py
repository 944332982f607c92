"""One streamed request to an OpenAI-compatible server, timed token by token (docs/DESIGN.md,
"Metrics").

The request is stamped when it is sent, each streamed chunk that carries a token when it is
parsed, the end when the chunk with `finish_reason` arrives. All stamps come from one monotonic
clock (`time.perf_counter`), taken relative to the start of the run. A request that gets an HTTP
error, an error event, an incomplete stream or times out is a failed record.

Output lengths follow the workload: `max_tokens` = its output length, plus `ignore_eos` (an
extension tokenslice and vLLM accept) so that the model cannot stop early. For tokenslice's
`srpt-oracle` the true length can go along as `tokenslice.expected_output_tokens`.

Token counting: the server's `usage.completion_tokens` (requested with
`stream_options.include_usage`) when it reports it, else the number of token chunks. tokenslice
and vLLM send one chunk per token; a server that merges tokens into one chunk gives fewer chunk
timestamps than tokens, and TBT is then measured between chunks (`chunks` records how many).
No torch here.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import httpx

from tokenslice.bench.client_config import ClientConfig
from tokenslice.bench.client_record import ClientRecord
from tokenslice.bench.workloads import WorkloadRequest

# Synthetic prompt ids stay in this range: below every real vocabulary size (builtin:tiny has 259).
SYNTHETIC_ID_LOW, SYNTHETIC_ID_SPAN = 100, 100


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


__all__ = ["SYNTHETIC_ID_LOW", "SYNTHETIC_ID_SPAN", "synthetic_prompt_ids", "prompt_for", "request_body",
           "stream_one"]
