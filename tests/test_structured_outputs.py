"""Structured outputs (model/grammar.py, server/structured.py): every token follows the request's
grammar (JSON schema, JSON object, regex, choice, EBNF) on the real engine and through the `openai`
client; a grammar survives preemption by recompute and by swap (same tokens as a run alone);
grammars compile off the step loop (a slow compile waits in the queue, one past the limit fails
with its reason); bad or competing constraints are 400s naming their field."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest

from conftest import STORIES
from serverkit import HTTP_TIMEOUT_S, RunningServer, start_server
from waves import LONG, PRESSURE, SHORT, run_waves
from tokenslice import LLM, SamplingParams
from tokenslice.request import EngineRequest, InvalidRequestError, StructuredOutput

# Names bounded by a pattern: xgrammar 0.2.9's rule for maxLength also lets raw control characters
# into a string, which a random model picks and JSON refuses.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = StructuredOutput("regex", "[a-z]+( [a-z]+)*")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Za-z ]{1,12}$")
    age: int = pydantic.Field(ge=0, le=120)


def _params(spec: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0, **kw}, structured=spec)


def test_every_kind_of_grammar_holds_on_the_engine() -> None:
    specs = [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("json_object"),
             StructuredOutput("choice", json.dumps(["yes", "no", "maybe so"])), WORDS,
             StructuredOutput("grammar", 'root ::= "The " ("cat" | "dog") " sat."')]
    with LLM(str(STORIES), kv_cache_blocks=64) as llm:
        outs = llm.generate(["Once upon a time"] * 4 + ["Lily"], [_params(s, max_tokens=200) for s in specs])
        person, obj, choice, words, sentence = [o.text for o in outs]
        assert set(json.loads(person)) == {"name", "age"} and 0 <= json.loads(person)["age"] <= 120
        assert outs[1].finish_reason == "length" or isinstance(json.loads(obj), dict)
        assert choice in ("yes", "no", "maybe so") and outs[2].finish_reason == "stop"
        assert re.fullmatch(WORDS.spec, words)
        assert sentence in ("The cat sat.", "The dog sat.")
        # Sampled rows follow their grammar too, each from its own seed.
        drawn = llm.generate(["Tom"] * 3, _params(StructuredOutput("json_schema", json.dumps(SCHEMA)),
                                                  temperature=1.0, seed=7))
        assert all(set(json.loads(o.text)) == {"name", "age"} for o in drawn)


@pytest.mark.parametrize("preemption", ["recompute", "reactive-swap", "proactive-swap"])
def test_a_grammar_survives_preemption_and_swaps(preemption: str) -> None:
    params = _params(WORDS, max_tokens=16)
    with LLM(str(STORIES), max_batch_size=1) as alone:
        expected = [alone.generate([p], params)[0].token_ids for p in LONG + SHORT]
    with LLM(str(STORIES), **{**PRESSURE, "preemption": preemption}) as llm:
        assert run_waves(llm.engine, LONG, SHORT, params) == expected
        stats = llm.engine.scheduler.stats
        assert stats.preemptions > 0
        if preemption != "recompute":
            assert stats.swap_out_bytes > 0
        texts = [llm.tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
        assert all(re.fullmatch(WORDS.spec, t) for t in texts)


def test_grammars_compile_off_the_step_loop() -> None:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    with LLM(str(STORIES), kv_cache_blocks=64) as llm:
        queue = llm.engine.grammar_queue
        queue.submit_wait_s = 0.0  # every compile waits in the queue: admitted at a later step
        free = llm.engine.add_request("Lily", SamplingParams(max_tokens=8, temperature=0))
        constrained = llm.engine.add_request("Tom", _params(spec))
        assert len(queue) == 1 and llm.engine.has_unfinished()
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert free.is_finished and constrained.is_finished
        assert set(json.loads(llm.tokenizer.decode(constrained.output_token_ids, skip_special_tokens=True))) == {"name", "age"}
        # A compile that outlives the limit fails its request, with why: the compile thread is
        # held busy, so the next grammar cannot be ready in time.
        gate = threading.Event()
        queue._pool.submit(gate.wait)
        queue.compile_limit_s = 0.0
        try:
            with pytest.raises(InvalidRequestError, match="did not compile within"):
                llm.generate(["Tom"], _params(StructuredOutput("regex", "[0-9]{3}")))
        finally:
            gate.set()
        assert not llm.engine.has_unfinished()


def test_a_grammar_the_library_refuses_is_an_invalid_request() -> None:
    with LLM(str(STORIES), kv_cache_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match="structured output"):
            llm.generate(["Tom"], _params(StructuredOutput("regex", "(ab")))


# ---- over HTTP, with the openai client --------------------------------------------------------

@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--kv-cache-blocks", "64", "--max-model-len", "512", "--max-batch-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Who is Tom?"}]


def test_the_sdk_parses_a_pydantic_response_format(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model="builtin:tiny", messages=MESSAGES, response_format=Person,
                                        max_tokens=200, temperature=0)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_structured_fields_on_both_endpoints(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="builtin:tiny", messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
    assert set(json.loads(chat.choices[0].message.content)) == {"name", "age"}
    choice = client.completions.create(model="builtin:tiny", prompt="Yes or no?", max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model="builtin:tiny", prompt="A code:", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[A-Z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[A-Z]{2}", regex.choices[0].text)
    grammar = client.completions.create(model="builtin:tiny", prompt="Say:", max_tokens=8, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= "on" | "off"'})
    assert grammar.choices[0].text in ("on", "off")


def test_a_streamed_constrained_answer_is_the_unstreamed_one(client: openai.OpenAI) -> None:
    kw = dict(model="builtin:tiny", messages=MESSAGES, max_tokens=200, temperature=0,
              extra_body={"guided_json": SCHEMA})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole and set(json.loads(whole)) == {"name", "age"}


def _post(srv: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(srv.url("/v1/chat/completions"), timeout=HTTP_TIMEOUT_S,
                      json={"messages": MESSAGES, "max_tokens": 4, **body})


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_or_competing_constraints_are_400s_naming_their_field(srv: RunningServer, body: dict,
                                                                  param: str) -> None:
    r = _post(srv, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_null_structured_fields_mean_free_text(srv: RunningServer) -> None:
    nulls = {"response_format": None, "structured_outputs": None, "guided_json": None, "guided_regex": None,
             "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": None}
    assert _post(srv, nulls).status_code == 200
    assert _post(srv, {"response_format": {"type": "text"}}).status_code == 200


def test_a_requests_own_delivery_rate_reaches_the_scheduler_on_both_paths() -> None:
    """`tokenslice.delivery_rate` (the stall guard's reader pace) is the request's, whether it joins
    the scheduler at once or after its grammar compiled in the queue."""
    with LLM(str(STORIES), kv_cache_blocks=64) as llm:
        engine = llm.engine
        engine.grammar_queue.submit_wait_s = 0.0
        engine.add(EngineRequest("free", [1, 5, 9], SamplingParams(max_tokens=2), delivery_rate=3.0))
        engine.add(EngineRequest("json", [1, 5, 9], _params(StructuredOutput("json_object"), max_tokens=2),
                                 delivery_rate=7.0))
        assert engine.scheduler.requests["free"].delivery_rate == 3.0 and "json" not in engine.scheduler.requests
        while "json" not in engine.scheduler.requests:
            engine.step()
        assert engine.scheduler.requests["json"].delivery_rate == 7.0
