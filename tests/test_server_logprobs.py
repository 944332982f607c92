"""Logprobs, echo, n / best_of and prompt lists over HTTP (real server, `openai` client and httpx):
the values equal transformers' log-softmax on stories260k; the shapes are what lm-eval's
local-completions, vLLM's benchmark_serving.py and the OpenAI SDK read."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import STORIES
from serverkit import RunningServer, start_server, wait_idle

TINY = "builtin:tiny"
PROMPT = "Once upon a time"
LONG_PROMPT = "Once upon a time, in a land far far away"  # 40 bytes: two full KV blocks


@pytest.fixture(scope="module")
def stories() -> Iterator[RunningServer]:
    with start_server("--model", str(STORIES), "--max-model-len", "256", "--max-batch-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def tiny() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "64", "--max-model-len", "256", "--max-batch-size", "16") as s:
        yield s


def _client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()

    def run(prompt: list[int], new: int) -> tuple[list[int], list[float], list[float]]:
        """Greedy continuation, each prompt token's logprob (from position 1), each generated one's,
        and the top-1 logprob at every position."""
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0].tolist() if new else list(prompt)
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return ids[len(prompt):], [float(lp[j, ids[j + 1]]) for j in range(len(ids) - 1)], \
            lp.max(dim=-1).values[:-1].tolist()

    return run


def _close(got: list[float | None], want: list[float]) -> bool:
    return len(got) == len(want) and all(g is not None and abs(g - w) < 1e-4 for g, w in zip(got, want, strict=True))


def test_completion_logprobs_equal_transformers(stories: RunningServer, reference) -> None:
    prompt = stories.tokenizer(PROMPT)["input_ids"]
    out, want, _ = reference(prompt, 6)
    r = _client(stories).completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=3, echo=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert _close(lp.token_logprobs[1:], want)
    assert len(lp.tokens) == len(prompt) + 6 == r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.text.startswith(PROMPT) and "".join(lp.tokens[len(prompt):]) == c.text[len(PROMPT):]
    assert lp.text_offset[len(prompt)] == len(PROMPT)
    for i in range(1, len(lp.tokens)):  # the token itself and its 3 alternatives; top-1 is the largest
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 3 <= len(top) <= 4 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
    # Without echo: only the generated tokens, offsets into the generated text.
    r2 = _client(stories).completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=0, extra_body={"ignore_eos": True})
    assert _close(r2.choices[0].logprobs.token_logprobs, want[len(prompt) - 1:])
    assert r2.choices[0].logprobs.text_offset[0] == 0 and r2.choices[0].text == c.text[len(PROMPT):]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(stories: RunningServer, reference, max_tokens: int) -> None:
    """lm-eval local-completions: token-id prompts, echo, logprobs 1, max_tokens 0 or 1, greedy."""
    prompts = [[1, 403, 263, 431, 292], [1, 365, 254, 471, 263, 31, 104, 289]]
    body = {"model": str(STORIES), "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0.0, "seed": 1234}
    r = httpx.post(stories.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for p, c in zip(prompts, data["choices"], strict=True):
        out, want, top1 = reference(p, max_tokens)
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert len(lp["tokens"]) == len(p) + max_tokens
        assert lp["token_logprobs"][0] is None and _close(lp["token_logprobs"][1:], want)
        # lm-eval's greedy check: the token's logprob is the largest in its top_logprobs.
        for i in range(1, len(p)):
            top = lp["top_logprobs"][i]
            assert abs(max(top.values()) - top1[i - 1]) < 1e-4
            assert lp["tokens"][i] in top
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert c["finish_reason"] == "length"


def test_streamed_logprobs_like_benchmark_serving(stories: RunningServer) -> None:
    """benchmark_serving.py --logprobs 1: a streamed completion, each chunk with its token's logprobs."""
    body = {"model": str(STORIES), "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", stories.url("/v1/completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    tokens = [c["choices"][0] for c in chunks if c["choices"]]
    assert len(tokens) == 8 and all(len(t["logprobs"]["token_logprobs"]) == 1 for t in tokens)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    whole = _client(stories).completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=8, temperature=0,
                                                logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    assert [t["logprobs"]["token_logprobs"][0] for t in tokens] == pytest.approx(whole.logprobs.token_logprobs)
    assert [t["logprobs"]["text_offset"][0] for t in tokens] == whole.logprobs.text_offset
    assert "".join(t["text"] for t in tokens) == whole.text


def test_streamed_echo_with_logprobs(stories: RunningServer) -> None:
    stream = _client(stories).completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=3, temperature=0,
                                                 logprobs=1, echo=True, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[0] is None
    whole = _client(stories).completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=3, temperature=0,
                                                logprobs=1, echo=True).choices[0]
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == whole.logprobs.token_logprobs
    assert "".join(c.text for c in chunks) == whole.text


def test_chat_logprobs_shape(tiny: RunningServer) -> None:
    client = _client(tiny)
    r = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for e in content:
        assert isinstance(e.token, str) and e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and abs(values[0] - e.logprob) < 1e-5  # greedy: top-1
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    plain = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
    stream = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            logprobs=True, top_logprobs=3, temperature=0, stream=True)
    streamed = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def _background_load(srv: RunningServer, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                c.post(srv.url("/v1/completions"), json={"prompt": "noise", "max_tokens": 7, "temperature": 1.0})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_n_with_seed_is_distinct_and_reproducible_under_load(tiny: RunningServer) -> None:
    client = _client(tiny)

    def three() -> list[str]:
        r = client.completions.create(model=TINY, prompt=LONG_PROMPT, max_tokens=12, n=3, seed=42, temperature=1.0)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        # The prompt is counted once, every choice's tokens are.
        assert r.usage.prompt_tokens == len(tiny.tokenizer(LONG_PROMPT)["input_ids"])
        assert 3 <= r.usage.completion_tokens <= 36
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    hits = 'tokenslice:prefix_cache_hits_total{model_name="builtin:tiny",tier="device"}'
    before = wait_idle(tiny).get(hits, 0.0)
    alone = three()
    assert len(set(alone)) == 3
    # The siblings attached the first one's two full prompt blocks instead of computing them.
    assert wait_idle(tiny)[hits] - before == 2 * 32
    stop = threading.Event()
    load = _background_load(tiny, stop)
    try:
        assert three() == alone
    finally:
        stop.set()
        load.join(60)
    # The first sample is the one n=1 with the same seed gives.
    one = client.completions.create(model=TINY, prompt=LONG_PROMPT, max_tokens=12, seed=42, temperature=1.0)
    assert one.choices[0].text == alone[0]


def test_best_of_keeps_the_highest_cumulative_logprob(tiny: RunningServer) -> None:
    client = _client(tiny)
    args = dict(model=TINY, prompt=PROMPT, max_tokens=6, seed=7, temperature=1.0, logprobs=0,
                extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, **args).choices  # the same four samples best_of draws
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every}
    assert len(score) == 4
    best = client.completions.create(n=2, best_of=4, **args).choices
    assert [c.index for c in best] == [0, 1]
    assert [c.text for c in best] == sorted(score, key=score.get, reverse=True)[:2]
    # Without logprobs asked for, best_of ranks the same way and returns none.
    quiet = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=6, seed=7, temperature=1.0, n=2,
                                      best_of=4, extra_body={"ignore_eos": True}).choices
    assert [c.text for c in quiet] == [c.text for c in best] and all(c.logprobs is None for c in quiet)


def test_prompt_list_times_n(tiny: RunningServer) -> None:
    client = _client(tiny)
    prompts = ["Once upon a time", "The cat sat"]
    r = client.completions.create(model=TINY, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=TINY, prompt=p, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text
    tok = tiny.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert r.usage.completion_tokens == 16
    ids = client.completions.create(model=TINY, prompt=[tok(p)["input_ids"] for p in prompts], max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in ids.choices] == [r.choices[0].text, r.choices[2].text]


def test_prompt_logprobs_extension(stories: RunningServer, reference) -> None:
    prompt = [1, 403, 263, 431]
    r = httpx.post(stories.url("/v1/completions"), json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                         "prompt_logprobs": 2}, timeout=120).json()
    plp = r["choices"][0]["prompt_logprobs"]
    _, want, _ = reference(prompt, 0)
    assert plp[0] is None and len(plp) == len(prompt)
    for i, entry in enumerate(plp[1:]):
        mine = entry[str(prompt[i + 1])]
        assert abs(mine["logprob"] - want[i]) < 1e-4 and mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
    plain = httpx.post(stories.url("/v1/completions"), json={"prompt": prompt, "max_tokens": 1}, timeout=120).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_disconnect_aborts_every_choice(tiny: RunningServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny.url("/v1/completions"), json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first token
    m = wait_idle(tiny)
    assert m["tokenslice:num_requests_running"] == 0 and m["tokenslice:num_requests_waiting"] == 0


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),  # without echo there is nothing to return
    ({"n": 129}, "n"),
])
def test_completion_bounds(tiny: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(tiny.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2} | body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_bounds(tiny: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(tiny.url("/v1/chat/completions"),
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_top_k_past_the_vocabulary_is_off(tiny: RunningServer) -> None:
    # Found by the schema fuzzer: a top_k past 64 bits must not break the engine-core message.
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(tiny.url("/v1/completions"), json=body, timeout=60).json()["choices"][0]["text"]
    r = httpx.post(tiny.url("/v1/completions"), json=body | {"top_k": 421902607005053747200}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
