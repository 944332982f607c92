"""The OpenAI-compatible API through the official `openai` client against a real server."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from serverkit import RunningServer, start_server

MODEL = "builtin:tiny"
PROMPT = "Once upon a time"
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "64", "--max-model-len", "256", "--max-batch-size", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(srv: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def n_tokens(srv: RunningServer, text: str) -> int:
    return len(srv.tokenizer(text)["input_ids"])


# ---- health, models, metrics ------------------------------------------------------------------
def test_health_and_models(srv: RunningServer, client: openai.OpenAI) -> None:
    r = httpx.get(srv.url("/health"))
    assert r.status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_names(srv: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    m = srv.metrics()
    for name in ["tokenslice:num_requests_running", "tokenslice:num_requests_waiting",
                 "tokenslice:num_requests_preempted", "tokenslice:num_requests_swapped",
                 "tokenslice:kv_cache_usage_perc", "tokenslice:cpu_cache_usage_perc",
                 "tokenslice:num_preemptions_total", "tokenslice:kv_swap_out_bytes_total",
                 "tokenslice:kv_swap_in_bytes_total", "tokenslice:prompt_tokens_total",
                 "tokenslice:generation_tokens_total", "tokenslice:time_to_first_token_seconds_count",
                 "tokenslice:inter_token_latency_seconds_count", "tokenslice:e2e_request_latency_seconds_count",
                 "tokenslice:request_queue_time_seconds_count"]:
        assert name in m, name
    assert m["tokenslice:generation_tokens_total"] >= 3
    assert m["tokenslice:kv_cache_num_blocks"] == 64


def test_per_user_metrics(srv: RunningServer, client: openai.OpenAI) -> None:
    """Service and latency per OpenAI `user` (fair-share serving); requests without one count as _none."""
    before = srv.metrics()
    for user, n in (("alice", 3), ("bob", 5), ("alice", 4)):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n, user=user, extra_body={"ignore_eos": True})
    m = srv.metrics()

    def delta(key: str) -> float:
        return m.get(key, 0.0) - before.get(key, 0.0)

    label = 'model_name="{}",user="{}"'
    assert delta("tokenslice:user_generation_tokens_total{" + label.format(MODEL, "alice") + "}") == 7
    assert delta("tokenslice:user_generation_tokens_total{" + label.format(MODEL, "bob") + "}") == 5
    assert delta("tokenslice:user_prompt_tokens_total{" + label.format(MODEL, "bob") + "}") == n_tokens(srv, PROMPT)
    assert delta("tokenslice:user_e2e_request_latency_seconds_count{" + label.format(MODEL, "alice") + "}") == 2
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert srv.metrics()["tokenslice:user_generation_tokens_total{" + label.format(MODEL, "_none") + "}"] >= 2


# ---- completions --------------------------------------------------------------------------------
def test_completion_usage_counts(srv: RunningServer, client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == n_tokens(srv, PROMPT)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completion_token_id_prompt_and_echo(srv: RunningServer, client: openai.OpenAI) -> None:
    ids = srv.tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = run(11)
    assert run(11) == first
    assert any(run(s) != first for s in (12, 13, 14))


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_string_honoured(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # A stop string taken from the middle of the greedy output; generation must end before it.
    candidates = [full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].isprintable()
                  and full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2]]
    assert candidates, f"no usable stop string in {full!r}"
    stop = candidates[0]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == r.choices[0].text


# ---- chat ---------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def test_chat_non_stream_and_stream(srv: RunningServer, client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(max_completion_tokens=9, **kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    rendered = srv.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(srv.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert full.usage.completion_tokens == 9

    chunks = list(client.chat.completions.create(max_tokens=9, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(srv: RunningServer, client: openai.OpenAI, chat: bool) -> None:
    """vLLM's stream_options.continuous_usage_stats: usage so far on every chunk (with include_usage)."""
    def stream(opts: dict) -> list:
        kw = dict(model=MODEL, max_tokens=6, stream=True, stream_options=opts, extra_body={"ignore_eos": True})
        if chat:
            return list(client.chat.completions.create(messages=MESSAGES, **kw))
        return list(client.completions.create(prompt=PROMPT, **kw))

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert prompt_tokens > 0 and chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert all(c.usage is not None for c in chunks)
    for c in chunks:
        u = c.usage
        assert u.prompt_tokens == prompt_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens
    so_far = [c.usage.completion_tokens for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 6
    # One chunk per generated token, each counted by the time it is sent (chat opens with the role, at 0).
    assert sorted(set(so_far)) == list(range(0 if chat else 1, 7))
    # Without include_usage (as vLLM) or without the flag: only the usual final usage chunk, if any.
    assert all(c.usage is None for c in stream({"continuous_usage_stats": True}))
    plain = stream({"include_usage": True})
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 6


def test_chat_default_max_tokens_runs_to_context(srv: RunningServer, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == srv.info.max_model_len


def test_chat_content_parts(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    a = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=4,
                                       temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_async_client(aclient: openai.AsyncOpenAI) -> None:
    async def main() -> None:
        c = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=1)
        chat = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=1)
        stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=1,
                                                       stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert c.usage.completion_tokens <= 4
        assert text == chat.choices[0].message.content
        with pytest.raises(openai.NotFoundError):  # an unknown model is 404, as OpenAI and vLLM answer
            await aclient.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
        await aclient.close()

    asyncio.run(main())


# ---- errors -------------------------------------------------------------------------------------
def _assert_400(exc: pytest.ExceptionInfo[openai.BadRequestError], param: str | None) -> None:
    assert exc.value.status_code == 400
    err = exc.value.body
    assert isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(prompt="x" * 300), "prompt"),  # longer than --max-model-len 256
    (dict(prompt=[1, 2, 999999]), "prompt"),  # not in the vocabulary
    (dict(prompt=""), "prompt"),
    (dict(prompt=["a", ""]), "prompt"),
    (dict(seed=2**70), "seed"),
    (dict(extra_body={"min_tokens": 50}), "min_tokens"),
    (dict(extra_body={"priority": "high"}), "priority"),
    (dict(extra_body={"priority": 3}), "priority"),  # this server's fcfs does not use priorities
    (dict(extra_body={"tokenslice": {"expected_output_tokens": -1}}), "tokenslice"),
])
def test_completion_invalid_fields(client: openai.OpenAI, kwargs: dict, param: str | None) -> None:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**args)
    _assert_400(exc, param)


@pytest.mark.parametrize("kwargs, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (dict(logprobs="yes"), "logprobs"),
])
def test_chat_invalid_fields(client: openai.OpenAI, kwargs: dict, param: str | None) -> None:
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**args)
    _assert_400(exc, param)


def test_raw_http_errors(srv: RunningServer) -> None:
    cases = [
        (httpx.post(srv.url("/v1/completions"), content=b"{not json", headers={"Content-Type": "application/json"}),
         400),
        (httpx.post(srv.url("/v1/completions"), json=[1, 2]), 400),
        (httpx.post(srv.url("/v1/completions"), json={"max_tokens": 3}), 400),  # no prompt
        (httpx.get(srv.url("/v1/nothing-here")), 404),
        (httpx.get(srv.url("/v1/completions")), 405),
        (httpx.post(srv.url("/v1/completions"), json={"prompt": "x" * (5 * 1024 * 1024)}), 413),
    ]
    for r, status in cases:
        assert r.status_code == status, (status, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}


def test_hopelessly_long_prompt_refused_before_tokenizing(client: openai.OpenAI) -> None:
    for call in (lambda: client.completions.create(model=MODEL, prompt="z" * 3_000_000, max_tokens=2),
                 lambda: client.chat.completions.create(
                     model=MODEL, messages=[{"role": "user", "content": "z" * 3_000_000}], max_tokens=2)):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert "characters" in exc.value.body["message"]


def test_body_limit_through_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="y" * (5 * 1024 * 1024), max_tokens=2)
    assert exc.value.status_code == 413


def test_engine_keeps_serving_after_bad_requests(srv: RunningServer, client: openai.OpenAI) -> None:
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x" * 1000, max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(srv.url("/health")).status_code == 200


def test_request_log_line_without_prompt_text(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    secret = "PINEAPPLE-SECRET-TEXT"
    with caplog.at_level(logging.INFO, logger="tokenslice.server"):
        r = client.completions.create(model=MODEL, prompt=secret, max_tokens=3)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenslice.server"]
    mine = [line for line in lines if r.id in line]
    assert len(mine) == 1 and "prompt_tokens=" in mine[0] and "latency=" in mine[0]
    assert not any(secret in line for line in lines)
    assert not any(r.choices[0].text and r.choices[0].text in line for line in lines if len(r.choices[0].text) > 3)


def test_chat_without_template_is_400() -> None:
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "16",
                      "--served-model-name", "stories") as s:
        c = openai.OpenAI(base_url=s.url("/v1"), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=4)
        _assert_400(exc, "messages")
        assert "chat template" in exc.value.body["message"]
        ok = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=4)
        assert ok.usage.completion_tokens >= 1


def test_scheduling_fields_reach_the_engine() -> None:
    # A priority needs a policy that uses it (other policies refuse it: test_completion_invalid_fields).
    with start_server("--policy", "priority", "--kv-cache-blocks", "64", "--max-model-len", "256",
                      "--no-engine-process") as srv:  # reads the engine's own Request
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=200, stream=True, user="alice",
            extra_body={"ignore_eos": True, "priority": 5, "tokenslice": {"expected_output_tokens": 7}})
        first = next(iter(stream))
        req = srv.engine.scheduler.requests.get(first.id)  # live while we hold the stream open
        stream.close()
    assert req is not None
    assert (req.priority, req.user, req.expected_output_tokens) == (5, "alice", 7)


def test_priority_route_refused_by_policies_without_priorities(srv: RunningServer) -> None:
    r = httpx.post(srv.url("/v1/requests/cmpl-x/priority"), json={"priority": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--policy priority" in r.json()["error"]["message"]
    r = httpx.post(srv.url("/v1/requests/cmpl-x/priority"), json={"priority": 0}, timeout=30)
    assert r.status_code == 404  # 0 changes nothing under any policy; the request is not live


def test_per_user_series_are_bounded() -> None:
    from tokenslice.engine.protocol import EngineStats
    from tokenslice.server.metrics import MAX_METRIC_USERS, OTHER_USERS, ServerMetrics

    sm = ServerMetrics("m", stats=EngineStats, queued=lambda: 0)
    labels = [sm._user_label(f"u{i}") for i in range(MAX_METRIC_USERS + 5)]
    assert labels[:MAX_METRIC_USERS] == [f"u{i}" for i in range(MAX_METRIC_USERS)]
    assert set(labels[MAX_METRIC_USERS:]) == {OTHER_USERS}
    assert sm._user_label("u0") == "u0"  # a known user keeps its series
