"""Sampling controls and strict request validation over HTTP, with the `openai` client and httpx
against a real server on stories260k (and builtin:tiny for chat, which needs a chat template)."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from conftest import STORIES
from serverkit import RunningServer, start_server

MODEL = "stories"
PROMPT = "Once upon a time"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--model", str(STORIES), "--served-model-name", MODEL, "--kv-cache-blocks", "64",
                      "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "32", "--max-model-len", "128", "--max-batch-size", "4") as s:
        yield s


def complete(client: openai.OpenAI, max_tokens: int = 30, **extra: object) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body=extra or None)


def output_ids(srv: RunningServer, text: str) -> list[int]:
    """The token ids of a greedy continuation of PROMPT (SentencePiece keeps them stable here)."""
    tok = srv.tokenizer
    prompt = tok(PROMPT)["input_ids"]
    full = tok(PROMPT + text)["input_ids"]
    assert full[:len(prompt)] == prompt
    return full[len(prompt):]


def test_logit_bias_bans_and_forces(srv: RunningServer, client: openai.OpenAI) -> None:
    base = complete(client).choices[0].text
    first = output_ids(srv, base)[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                       logit_bias={str(first): -100}).choices[0].text
    assert banned != base and output_ids(srv, banned)[0] != first
    comma = srv.tokenizer.convert_tokens_to_ids(",")
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(comma): 100})
    assert forced.choices[0].text == ",,,," and forced.usage.completion_tokens == 4


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.5), ("presence_penalty", 1.5),
                                          ("frequency_penalty", 1.5)])
def test_penalties_change_the_greedy_output(client: openai.OpenAI, field: str, value: float) -> None:
    base = complete(client, 60).choices[0].text
    if field == "repetition_penalty":
        out = complete(client, 60, repetition_penalty=value).choices[0].text
    else:  # OpenAI fields: the SDK's own arguments
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                        **{field: value}).choices[0].text
    assert out != base
    assert len(set(out.split())) > len(set(base.split()))  # fewer repeated words


def test_min_p_one_is_greedy(client: openai.OpenAI) -> None:
    base = complete(client).choices[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=1.5, seed=4,
                                    extra_body={"min_p": 1.0}).choices[0].text
    assert out == base


def test_stop_token_ids_and_include_stop_str(srv: RunningServer, client: openai.OpenAI) -> None:
    base = complete(client).choices[0].text
    tok = output_ids(srv, base)[5]
    cut = complete(client, stop_token_ids=[tok])
    kept = complete(client, stop_token_ids=[tok], include_stop_str_in_output=True)
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == kept.usage.completion_tokens == 6
    assert base.startswith(kept.choices[0].text) and kept.choices[0].text.startswith(cut.choices[0].text)
    assert len(kept.choices[0].text) > len(cut.choices[0].text)
    by_str = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=["Lily"],
                                       extra_body={"include_stop_str_in_output": True}).choices[0]
    assert by_str.finish_reason == "stop" and by_str.text == base[:base.index("Lily") + len("Lily")]


def test_skip_special_tokens(srv: RunningServer, client: openai.OpenAI) -> None:
    bos = srv.tokenizer.bos_token_id
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(bos): 100})
    assert client.completions.create(**kw).choices[0].text == ""
    shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<s>" * 3
    spaced = client.completions.create(**kw, extra_body={"skip_special_tokens": False,
                                                        "spaces_between_special_tokens": False})
    assert spaced.choices[0].text.replace(" ", "") == "<s>" * 3


def test_streamed_text_matches(client: openai.OpenAI) -> None:
    extra = {"repetition_penalty": 1.3, "include_stop_str_in_output": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=["park"],
                                      extra_body=extra).choices[0].text
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=["park"],
                                       stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole


def test_chat_accepts_the_controls(chat_srv: RunningServer) -> None:
    c = openai.OpenAI(base_url=chat_srv.url("/v1"), api_key="x", max_retries=0, timeout=60)
    tok = chat_srv.tokenizer.convert_tokens_to_ids("a")
    msgs = [{"role": "user", "content": "Hi!"}]
    r = c.chat.completions.create(model="builtin:tiny", messages=msgs, max_tokens=3, temperature=0,
                                  logit_bias={str(tok): 100}, presence_penalty=0.1, frequency_penalty=0.1,
                                  extra_body={"repetition_penalty": 1.1, "min_p": 0.1, "stop_token_ids": [5],
                                              "skip_special_tokens": True, "include_stop_str_in_output": False,
                                              "spaces_between_special_tokens": True, "ignore_eos": True})
    assert r.choices[0].message.content == "aaa"


# ---- strict validation ----------------------------------------------------------------------------
# Fields neither route declares (even null is refused: a client that sends one expects an effect).
# The OpenAI chat fields (tools, response_format, functions, ...) and vLLM's structured-output fields
# take null as their default: tests/test_tool_calls.py and tests/test_structured_outputs.py.
UNSUPPORTED = ["tools_choice", "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words",
               "truncate_prompt_tokens", "chat_template", "chat_template_kwargs", "add_special_tokens",
               "return_tokens_as_token_ids", "prompt_embeds", "cache_salt", "kv_transfer_params", "vllm_xargs",
               "request_id", "documents", "no_such_field"]
CHAT_ONLY = ["tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "reasoning_effort",
             "modalities", "audio", "prediction", "web_search_options"]


@pytest.mark.parametrize("route,field", [(route, f) for route in ("/v1/completions", "/v1/chat/completions")
                                         for f in UNSUPPORTED] + [("/v1/completions", f) for f in CHAT_ONLY])
def test_unsupported_field_is_400_naming_it(srv: RunningServer, chat_srv: RunningServer, route: str,
                                            field: str) -> None:
    server = srv if route == "/v1/completions" else chat_srv
    body = ({"prompt": PROMPT} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": "Hi"}]}) | {"max_tokens": 2, field: None}
    r = httpx.post(server.url(route), json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options"),
    ({"tokenslice": {"expected_output_tokens": 3, "hint": 1}}, "tokenslice"),
])
def test_unknown_nested_field_is_400(srv: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2} | body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_unknown_message_field_is_400(chat_srv: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi", "tool_calls": []}], "max_tokens": 2}
    r = httpx.post(chat_srv.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "tool_calls" in r.json()["error"]["message"]


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "top_logprobs", 2), ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "best_of", 2), ("/v1/chat/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "best_of", True)])
def test_unimplemented_field_switched_on_is_400(srv: RunningServer, chat_srv: RunningServer, route: str,
                                                field: str, value: object) -> None:
    """Accepted only with the value that means off; any value that would change the answer is refused."""
    body = ({"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    server = srv if route == "/v1/completions" else chat_srv
    r = httpx.post(server.url(route), json=body | {"max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_streamed_prompt_logprobs_without_echo_is_400(srv: RunningServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("field, value", [("metadata", {"k": "v"}), ("store", False), ("service_tier", "auto"),
                                          ("best_of", 1), ("prompt_logprobs", None), ("top_logprobs", None),
                                          ("user", "alice"), ("logprobs", None), ("echo", False)])
def test_allowed_fields_still_work(srv: RunningServer, chat_srv: RunningServer, field: str, value: object) -> None:
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 200, r.text
    if field != "logprobs":
        r = httpx.post(chat_srv.url("/v1/chat/completions"), timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value})
        assert r.status_code == 200, r.text


def test_benchmark_clients_bodies_are_accepted(srv: RunningServer, chat_srv: RunningServer) -> None:
    """What vLLM's serving benchmark, guidellm and lm-eval send (field for field)."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    completions = [
        {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
         "ignore_eos": True} | stream,  # vLLM benchmarks
        {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": 4, "ignore_eos": True}
        | stream,  # older vLLM benchmark_serving.py
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stop": None, "ignore_eos": True} | stream,  # guidellm
        {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "stop": ["\n\n"], "seed": 1234},  # lm-eval
    ]
    for body in completions:
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    chats = [
        {"model": "builtin:tiny", "messages": msgs, "max_completion_tokens": 4, "ignore_eos": True} | stream,
        {"model": "builtin:tiny", "messages": msgs, "max_tokens": 4, "max_completion_tokens": 4, "stop": None,
         "ignore_eos": True} | stream,
        {"model": "builtin:tiny", "messages": msgs, "max_tokens": 4, "temperature": 0, "stop": ["x"], "seed": 1},
    ]
    for body in chats:
        r = httpx.post(chat_srv.url("/v1/chat/completions"), json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # stories260k has 512 tokens
    ({"logit_bias": {"9" * 40: 1}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_invalid_controls_are_400(srv: RunningServer, extra: dict, param: str) -> None:
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2} | extra, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_max_tokens_beyond_the_context_is_400(srv: RunningServer, client: openai.OpenAI) -> None:
    n_prompt = len(srv.tokenizer(PROMPT)["input_ids"])
    room = MAX_MODEL_LEN - n_prompt
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=room + 1)
    assert exc.value.body["param"] == "max_tokens" and str(MAX_MODEL_LEN) in exc.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=room, extra_body={"ignore_eos": True})
    assert ok.usage.total_tokens == MAX_MODEL_LEN


def test_chat_max_tokens_beyond_the_context_is_400(chat_srv: RunningServer) -> None:
    c = openai.OpenAI(base_url=chat_srv.url("/v1"), api_key="x", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Hi"}]
    for kw, param in ((dict(max_tokens=128), "max_tokens"), (dict(max_completion_tokens=500), "max_completion_tokens")):
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="builtin:tiny", messages=msgs, **kw)
        assert exc.value.body["param"] == param
    # Without a limit, the reply may use the rest of the context.
    r = c.chat.completions.create(model="builtin:tiny", messages=msgs, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == 128
