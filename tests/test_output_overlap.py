"""Output processing overlaps the next step in both server modes (engine core in its own process,
or on a thread): detokenization and stop strings run on the API server's side while the engine
computes on. Token-level exactness is kept: a stream stopped by a stop string ends exactly at
it, with no extra token or event, and the engine frees the request's KV."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from serverkit import start_server, wait_idle

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
PROMPT = "Once upon a time"
MODES = ("--engine-process", "--no-engine-process")

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260k")


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    """Every SSE data event of a streamed completion, parsed ("[DONE]" kept as is)."""
    out: list[Any] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_ends_the_stream_exactly(mode: str) -> None:
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "32", mode) as srv:
        body = {"model": str(STORIES), "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        full = httpx.post(srv.url("/v1/completions"), json=body, timeout=60).json()["choices"][0]["text"]
        stop = "girl"  # ", there was a little girl named Lily. ..."
        assert stop in full
        events = _events(srv.base_url, {**body, "stop": [stop], "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.index(stop)]
        # The finish is the last choice event: nothing of the token computed after it is sent.
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
        # Tokens up to the one that completed the stop string, as the unstopped run produced them.
        assert len(usage) == 1
        cut = httpx.post(srv.url("/v1/completions"), json={**body, "stop": [stop]}, timeout=60).json()
        assert cut["choices"][0]["text"] == full[:full.index(stop)]
        assert usage[0]["completion_tokens"] == cut["usage"]["completion_tokens"] < 40
        m = wait_idle(srv)
        assert m["tokenslice:kv_cache_usage_perc"] == 0
        reasons_seen = {k: v for k, v in m.items() if k.startswith("tokenslice:request_success_total{")}
        assert reasons_seen == {
            'tokenslice:request_success_total{finished_reason="length",model_name="%s"}' % STORIES: 1,
            'tokenslice:request_success_total{finished_reason="stop",model_name="%s"}' % STORIES: 2}


def test_thread_mode_engine_leaves_text_to_the_event_loop() -> None:
    """With the engine on a thread, its loop only steps: the text is made in the event loop."""
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "32", "--no-engine-process") as srv:
        assert srv.engine.detokenize is False
        r = httpx.post(srv.url("/v1/completions"), json={"model": str(STORIES), "prompt": PROMPT, "max_tokens": 12,
                                                          "temperature": 0}, timeout=60).json()
        assert r["choices"][0]["text"].startswith(", there was")
