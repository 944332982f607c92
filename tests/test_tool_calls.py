"""Tool calling on /v1/chat/completions (server/tools.py, prompts.py, chat.py): the parser of
`<tool_call>` blocks, whole and streamed; the rendering of tools, calls and results through chat
templates that read them and templates that do not; the grammars of tool_choice; and, on a real
server through the `openai` client, calls that follow their function's schema, streamed calls the
SDK accumulates, a second turn with the results, and the 400s of fields that contradict."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from conftest import SHARED
from serverkit import HTTP_TIMEOUT_S, RunningServer, start_server
from tokenslice.model.builtin import CHAT_TEMPLATE, builtin_tokenizer
from tokenslice.server.errors import APIError
from tokenslice.server.prompts import render_conversation
from tokenslice.server.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest, ChatMessage, ChatTool
from tokenslice.server.tools import ToolCallParser, check_tool_fields, parse_tool_calls, tool_grammar

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": {"type": "object", "properties": {}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- the parser ---------------------------------------------------------------------------------

def test_a_whole_block_is_a_call_and_no_content() -> None:
    content, calls = parse_tool_calls(CALL)
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    int(call.id[5:], 16)


def test_text_around_and_between_calls_is_the_content() -> None:
    text = f"  Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}\nDone. "
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n\n\nDone."  # the newlines around both calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2


def test_raw_control_characters_the_grammar_allows_are_escaped_in_the_arguments() -> None:
    [call] = parse_tool_calls(CALL.replace("Paris", "Pa\x1cris"))[1]
    assert call.function.arguments == '{"city": "Pa\\u001cris", "days": 3}'


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": {}}',  # never closed
])
def test_a_block_that_is_no_call_stays_in_the_content(block: str) -> None:
    content, calls = parse_tool_calls(f"Hi {block} {CALL}")
    assert content == f"Hi {block}".strip() + ("" if block.endswith("</tool_call>") else f" {CALL}")
    assert len(calls) == (1 if block.endswith("</tool_call>") else 0)


def test_streaming_holds_back_what_may_begin_a_call() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == ["Hello"]  # the space waits for more content, "<tool" for its end
    assert parser.feed("_call>\n{\"name\": \"get_weather\", ") == []
    call, after = parser.feed('"arguments": {"city": "Oslo", "days": 1}}\n</tool_call> Bye')
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Oslo"
    assert after == "  Bye"  # the held space and the one after the call, as parse_tool_calls joins them
    assert parser.feed("") == [] and parser.finish() == []
    # A "<" that turns out to be text is given out once it cannot begin a call.
    parser = ToolCallParser()
    assert parser.feed("a <") == ["a"]
    assert parser.feed(" b <tool_") == [" < b"]
    assert parser.feed("x>") == [" <tool_x>"]
    assert parser.finish() == []


def test_streamed_pieces_add_up_to_the_whole_text_parse() -> None:
    text = f"Sure.\n\n{CALL}\nand <b>then</b>\n{CALL}\n<tool_call>\nnot json\n</tool_call>\n<tool"
    content, calls = parse_tool_calls(text)
    for size in (1, 2, 5, 13):
        parser = ToolCallParser()
        items = [i for k in range(0, len(text), size) for i in parser.feed(text[k:k + size])] + parser.finish()
        assert "".join(i for i in items if isinstance(i, str)) == content
        assert [i.function for i in items if not isinstance(i, str)] == [c.function for c in calls]
        assert parser.num_calls == 2


# ---- rendering ----------------------------------------------------------------------------------

def _messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def _tools(raw: list[dict] = TOOLS) -> list[ChatTool]:
    return [ChatTool.model_validate(t) for t in raw]


SECOND_TURN = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
]


def test_a_template_that_ignores_tools_gets_them_in_its_system_message() -> None:
    tok = builtin_tokenizer()
    text = render_conversation(tok, CHAT_TEMPLATE, _messages(SECOND_TURN), True, _tools())
    assert text.count("<|system|>") == 1 and text.startswith("<|system|>\nYou are terse.\n\n# Tools")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in tools_block] == ["get_weather", "get_time"]
    # A function without parameters is announced as taking none.
    assert json.loads(tools_block[1])["function"]["parameters"] == {"type": "object", "properties": {}}
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call></s>') in text
    assert "<|tool|>\n<tool_response>\nsunny, 24C\n</tool_response></s>" in text
    assert text.endswith("<|assistant|>\n")
    # Without a system message of its own, the tools get one.
    text = render_conversation(tok, CHAT_TEMPLATE, _messages(ASK), True, _tools())
    assert text.startswith("<|system|>\n# Tools") and "<|user|>\nWhat is the weather" in text


def test_a_template_that_reads_tools_renders_them_itself() -> None:
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    text = render_conversation(tok, tok.chat_template, _messages(SECOND_TURN), True, _tools())
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools") and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text


# Templates that know only user and assistant messages: one refuses others, one leaves them out.
STRICT_ROLES = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('only user and assistant roles') }}{% endif %}"
                "[{{ m.role }}] {{ m.content }}\n{% endfor %}")
SOME_ROLES = ("{% for m in messages %}{% if m.role in ['user', 'assistant'] %}[{{ m.role }}] {{ m.content }}\n"
              "{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [STRICT_ROLES, SOME_ROLES])
def test_results_a_template_does_not_take_become_user_messages(template: str) -> None:
    tok = builtin_tokenizer()
    text = render_conversation(tok, template, _messages(SECOND_TURN[1:]), True, _tools())
    assert text.startswith("[user] # Tools") and "\n\nWhat is the weather in Paris?\n" in text
    assert '[assistant] <tool_call>\n{"name": "get_weather"' in text
    assert text.endswith("[user] <tool_response>\nsunny, 24C\n</tool_response>\n")


def test_tool_fields_on_the_wrong_message_are_refused() -> None:
    tok = builtin_tokenizer()
    wrong = [{"role": "user", "content": "x", "tool_calls": SECOND_TURN[2]["tool_calls"]},
             {"role": "user", "content": "x", "tool_call_id": "call_1"}]
    for message in wrong:
        with pytest.raises(APIError) as e:
            render_conversation(tok, CHAT_TEMPLATE, _messages([message]), True)
        assert e.value.param == "messages"


# ---- the grammars -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(builtin_tokenizer()), max_threads=1)


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})


def _accepts(compiler: xgr.GrammarCompiler, body: ChatCompletionRequest, text: str) -> bool:
    spec = tool_grammar(body)
    assert spec is not None and spec.kind == "structural_tag"
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(spec.spec))
    return matcher.accept_string(text) and matcher.is_completed()


TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_each_tool_choice_allows_its_outputs(compiler: xgr.GrammarCompiler) -> None:
    auto, required = _body(), _body(tool_choice="required")
    named = _body(tool_choice={"type": "function", "function": {"name": "get_time"}})
    cases = {  # text: (auto, required, named)
        "Just text.": (True, False, False),
        CALL: (True, True, False),
        TIME: (True, True, True),
        f"Let me see. {CALL}": (True, False, False),
        f"{CALL}\n{TIME}": (True, True, False),
        CALL.replace("3}", '"3"}'): (False, False, False),  # days is an integer
        CALL.replace("get_weather", "get_wind"): (False, False, False),
    }
    for text, allowed in cases.items():
        assert tuple(_accepts(compiler, b, text) for b in (auto, required, named)) == allowed, text
    assert not _accepts(compiler, _body(tool_choice="required", parallel_tool_calls=False), f"{CALL}\n{TIME}")
    assert tool_grammar(_body(tool_choice="none")) is None


def test_contradicting_tool_fields_are_refused_naming_the_field() -> None:
    cases = [({"tools": None, "tool_choice": "auto"}, "tool_choice"),
             ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
             ({"tool_choice": {"type": "function", "function": {"name": "get_wind"}}}, "tool_choice"),
             ({"tools": TOOLS + TOOLS[:1]}, "tools"),
             ({"response_format": {"type": "json_object"}}, "response_format"),
             ({"guided_regex": "a+", "tool_choice": "required"}, "guided_regex"),
             ({"functions": [{"name": "f"}]}, "functions")]
    for fields, param in cases:
        with pytest.raises(APIError) as e:
            check_tool_fields(_body(**fields))
        assert e.value.status == 400 and e.value.param == param, fields
    for fields in ({"tools": None, "tool_choice": "none"}, {"response_format": {"type": "json_object"},
                                                            "tool_choice": "none"},
                   {"response_format": {"type": "text"}}):
        check_tool_fields(_body(**fields))


# ---- over HTTP, with the openai client ----------------------------------------------------------

@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    # builtin:tiny spells one token per byte: the tools' description alone is over a thousand.
    with start_server("--kv-cache-blocks", "512", "--max-model-len", "2048", "--max-batch-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_returns_calls_that_follow_their_schema(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="builtin:tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _valid(call)
    # Each of n choices is parsed on its own; sampled ones too.
    out = client.chat.completions.create(model="builtin:tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=3, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for name in ("get_weather", "get_time"):
        out = client.chat.completions.create(model="builtin:tiny", messages=ASK, tools=TOOLS, max_tokens=120,
                                             tool_choice={"type": "function", "function": {"name": name}},
                                             temperature=0)
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == name and out.choices[0].finish_reason == "tool_calls"
        _valid(call)


def test_streamed_calls_accumulate_in_the_sdk(client: openai.OpenAI) -> None:
    kw = dict(model="builtin:tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
              temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        deltas = [e.chunk.choices[0].delta for e in stream if e.type == "chunk" and e.chunk.choices]
        final = stream.get_final_completion().choices[0]
    assert sum(len(d.tool_calls or []) for d in deltas) == 1  # the call comes whole, in one chunk
    assert final.finish_reason == "tool_calls" and not final.message.content
    [call] = final.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == whole.message.tool_calls[0].function.name
    assert _valid(call) == _valid(whole.message.tool_calls[0])


def test_streamed_logprobs_stay_one_per_token_with_calls(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="builtin:tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=0, logprobs=True, stream=True, stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and "".join(t.token for t in tokens).startswith("<tool_call>")


def test_auto_streams_the_same_content_and_calls_as_unstreamed(client: openai.OpenAI) -> None:
    kw = dict(model="builtin:tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_calls = [t.function for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == (whole.message.content or "")
    assert [(f.name, f.arguments) for f in streamed_calls] == [(t.function.name, t.function.arguments)
                                                               for t in whole.message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    for call in whole.message.tool_calls or []:
        _valid(call)


def test_a_second_turn_with_calls_and_results_is_accepted(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="builtin:tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"}]
    out = client.chat.completions.create(model="builtin:tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > first.usage.prompt_tokens


def _post(srv: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(srv.url("/v1/chat/completions"), timeout=HTTP_TIMEOUT_S,
                      json={"messages": ASK, "max_tokens": 4, "temperature": 0, **body})


NULL_FIELDS = ["functions", "function_call", "reasoning_effort", "modalities", "prediction", "audio",
               "web_search_options", "tools", "tool_choice", "parallel_tool_calls", "response_format"]


def test_every_null_openai_field_means_its_default(srv: RunningServer) -> None:
    r = _post(srv, dict.fromkeys(NULL_FIELDS))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"] == []


UNSUPPORTED_VALUES = {"functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
                      "reasoning_effort": "low", "modalities": ["text"],
                      "prediction": {"type": "content", "content": "x"}, "audio": {"voice": "alloy", "format": "mp3"},
                      "web_search_options": {}}


@pytest.mark.parametrize("field", UNSUPPORTED_CHAT_FIELDS)
def test_unsupported_openai_fields_are_400s_naming_them(srv: RunningServer, field: str) -> None:
    r = _post(srv, {field: UNSUPPORTED_VALUES[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wind"}}}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages"),
])
def test_contradicting_requests_are_400s(srv: RunningServer, body: dict, param: str) -> None:
    r = _post(srv, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tool_choice_none_renders_tools_but_constrains_nothing(srv: RunningServer) -> None:
    r = _post(srv, {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"},
                    "max_tokens": 40})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"] == []
    with_tools = httpx.post(srv.url("/tokenize"), json={"messages": ASK}, timeout=HTTP_TIMEOUT_S).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] > with_tools  # the tools' description is in the prompt


def test_the_schema_says_which_tool_bodies_are_refused(srv: RunningServer) -> None:
    spec = httpx.get(srv.url("/openapi.json"), timeout=HTTP_TIMEOUT_S).json()
    validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ChatCompletionRequest",
                                                 "components": spec["components"]})
    turn = [*ASK, {"role": "assistant", "tool_calls": SECOND_TURN[2]["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    cases = [({"tools": TOOLS, "tool_choice": "required"}, True),
             ({"tools": TOOLS, "messages": turn}, True),
             ({"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}}, True),
             ({"tools": TOOLS, "response_format": {"type": "text"}, "parallel_tool_calls": False}, True),
             ({"functions": None, "audio": None, "tool_choice": "none"}, True),
             ({"tool_choice": "auto"}, False),
             ({"tools": [], "tool_choice": "required"}, False),
             ({"tools": TOOLS, "response_format": {"type": "json_object"}}, False),
             ({"tools": TOOLS, "guided_choice": ["a"]}, False),
             ({"functions": [{"name": "f"}]}, False),
             ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, False),
             ({"messages": [{"role": "tool", "content": "x", "tool_calls": turn[1]["tool_calls"]}]}, False)]
    for body, allowed in cases:
        full = {"messages": ASK, "max_tokens": 4, "temperature": 0, **body}
        assert validator.is_valid(full) == allowed, body
        r = _post(srv, body)
        assert r.status_code == (200 if allowed else 400), (body, r.text)
