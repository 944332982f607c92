"""Pydantic schemas of the requests of the OpenAI wire format (completions, chat completions, tools,
structured outputs, tokenizer endpoints; answers: responses.py).

Models are strict: the API documents numbers as numbers, so "5" for max_tokens is a 400 rather
than a silent coercion, and the OpenAPI schema FastAPI derives from them is what fuzzers test.
Unknown fields are refused with a 400 that names them (`extra="forbid"`), so a setting the
server does not implement is never silently ignored; the one exception is IGNORED_FIELDS, a
short documented list of fields that change nothing here. Declared fields the engine does not
support yet are refused by the handlers with a clear 400.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tokenslice.request import (MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY,
                                sampling_default)

# torch.Generator.manual_seed accepts exactly this range; outside it, a request would crash the engine.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Samples per prompt (n, best_of): each is a scheduled request; more would only fill the queue.
MAX_CHOICES = 128
# Hints that policies may turn into floats: bounded so they convert exactly.
HINT_MIN, HINT_MAX = -(2**53), 2**53


def _integral(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer, and so do we; 1.5, "1" and true are still refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(ge: int | None = None, le: int | None = None) -> Any:
    """An integer field type; the bounds sit inside so the schema shows minimum/maximum."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


def _utf8(value: str) -> str:
    # JSON may spell lone UTF-16 surrogates (\ud800); no tokenizer can encode them.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
# Token ids: 64-bit, as the engine's wire (msgpack) and tensors carry them; the engine names ids
# outside the vocabulary.
Int = _int(ge=-(2**63), le=2**63 - 1)
TokenId = _int(ge=0, le=2**63 - 1)
PositiveInt = _int(ge=1)
NonNegativeInt = _int(ge=0)
TopK = _int(ge=-1)
Seed = _int(ge=SEED_MIN, le=SEED_MAX)
TopLogprobs = _int(ge=0, le=MAX_LOGPROBS)
Choices = _int(ge=1, le=MAX_CHOICES)
Hint = _int(ge=HINT_MIN, le=HINT_MAX)
NonNegativeHint = _int(ge=0, le=HINT_MAX)


# Request fields accepted and ignored when a request model does not declare them (README, "Strict
# fields"): OpenAI's stored-completion bookkeeping (`metadata`, `store`) and `service_tier`, which
# change nothing on a self-hosted server.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier"})
# Fields a route does not implement (`top_logprobs` on completions, `echo`, `best_of`,
# `prompt_logprobs` on chat) that clients send with a value meaning "off": accepted with that
# value only, any other value is refused with a 400 naming the field.
NO_OP_VALUES: dict[str, tuple[object, ...]] = {"top_logprobs": (None,), "echo": (None, False),
                                               "best_of": (None, 1), "prompt_logprobs": (None,)}


def _is_no_op(value: object, no_ops: tuple[object, ...]) -> bool:
    # Same type as well as equal: `best_of: true` is not 1, nor `echo: 0` false.
    return any(type(value) is type(v) and value == v for v in no_ops)


def _nullable_optionals(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The schema of a _Strict model: each optional field also takes null, which means its default
    (_Strict._null_means_default), so the schema allows exactly the nulls validation accepts."""
    props = schema.get("properties", {})
    for name, field in cls.model_fields.items():
        prop = props.get(name)
        if prop is None or field.is_required() or _takes_null(prop):
            continue
        meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        props[name] = {"anyOf": [dict(prop), {"type": "null"}], **meta}


def _takes_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(_takes_null(p) for p in prop.get("anyOf", ()))


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's API takes null for an optional field as "the default" (vLLM too): such a null is
        # dropped before validation, so the field keeps its default. A required field still refuses it.
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="with include_usage: usage so far on every chunk "
                                                            "(vLLM's extension)")


class TokensliceOptions(_Strict):
    """The `tokenslice` extension object: scheduling hints for experiments."""

    expected_output_tokens: NonNegativeHint | None = Field(
        None, description="true output length, read only by the srpt-oracle policy")
    delivery_rate: float | None = Field(
        None, gt=0, le=1e6, allow_inf_nan=False,
        description="this stream's reader pace in tokens/s: the stall guard keeps its tokens coming at "
                    "least this fast once it started (default: the server's --delivery-rate)")


# A schema, grammar or regex a request sends is compiled into a grammar: bounded, so that no
# request makes the server compile something huge (model/grammar.py bounds the compile time).
MAX_GRAMMAR_CHARS = 64 * 1024


class JsonSchemaSpec(_Strict):
    """response_format's json_schema (OpenAI): the schema the output must validate against."""

    name: Text = Field(max_length=256, description="the schema's name (reported back by nothing; OpenAI requires it)")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema; absent: any JSON object")
    strict: bool | None = Field(None, description="true or false alike: the output always follows the schema")


class ResponseFormat(_Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsSpec(_Strict):
    """vLLM's structured_outputs object: exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json",
                                                description="a JSON schema (object or its JSON text)")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, description="the output is one of these strings")
    grammar: Text | None = Field(None, description="an EBNF grammar (xgrammar's, GBNF-like)")
    json_object: bool | None = Field(None, description="true: any JSON object")
    structural_tag: Text | None = Field(None, description="an xgrammar structural tag, as JSON text")


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions. The sampling defaults are
    SamplingParams' (request.py); a null is dropped before validation (_Strict), so a field with a
    non-null default is never None on a validated request."""

    model: str | None = Field(None, description="must be the served model name; defaults to it")
    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(sampling_default("temperature"), ge=0, allow_inf_nan=False)
    top_p: float | None = Field(sampling_default("top_p"), gt=0, le=1, allow_inf_nan=False)
    top_k: TopK | None = Field(sampling_default("top_k"), description="0 or -1: off")
    seed: Seed | None = sampling_default("seed")
    stop: Text | list[Text] | None = sampling_default("stop")
    n: Choices = Field(1, description="choices per prompt, each sampled independently (a seed gives each "
                                          "its own stream derived from it)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(sampling_default("presence_penalty"), ge=-MAX_PENALTY, le=MAX_PENALTY,
                                    allow_inf_nan=False,
                                    description="subtracted from the logit of every token the output already holds")
    frequency_penalty: float = Field(sampling_default("frequency_penalty"), ge=-MAX_PENALTY, le=MAX_PENALTY,
                                     allow_inf_nan=False,
                                     description="subtracted once per occurrence of a token in the output so far")
    logit_bias: dict[str, float] | None = Field(
        sampling_default("logit_bias"),
        description="token id (as a string key) -> bias in [-100, 100] added to its logit")
    ignore_eos: bool = sampling_default("ignore_eos")
    min_tokens: NonNegativeInt = sampling_default("min_tokens")
    repetition_penalty: float | None = Field(
        sampling_default("repetition_penalty"), ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
        allow_inf_nan=False,
        description="vLLM's: logits of tokens in the prompt or output divided by it (if positive) or multiplied "
                    "(if negative); 1 is off")
    min_p: float | None = Field(sampling_default("min_p"), ge=0, le=1, allow_inf_nan=False,
                                description="drop tokens less likely than min_p x the most likely one; 0 is off")
    stop_token_ids: list[TokenId] | None = Field(sampling_default("stop_token_ids"),
                                                        description="token ids that end the output")
    include_stop_str_in_output: bool = Field(sampling_default("include_stop_str_in_output"),
                                             description="keep the stop string or stop token in the text")
    skip_special_tokens: bool = Field(sampling_default("skip_special_tokens"),
                                      description="leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(sampling_default("spaces_between_special_tokens"),
                                                description="(slow tokenizers only) space around special tokens "
                                                            "in the text")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema: "
                                                                     "the output follows it (a grammar masks "
                                                                     "every token)")
    structured_outputs: StructuredOutputsSpec | None = Field(None, description="vLLM's: one of json, regex, "
                                                                               "choice, grammar, json_object, "
                                                                               "structural_tag")
    guided_json: dict[str, Any] | Text | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: Text | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: list[Text] | None = Field(None, min_length=1,
                                             description="vLLM's older name of structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="vLLM's older name of structured_outputs.grammar")
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = Field(None, description="xgrammar (or auto), the "
                                                                                      "only backend")
    priority: Hint = Field(0, description="lower runs first under --policy priority; other policies "
                                          "refuse anything but 0; change it later with "
                                          "POST /v1/requests/{id}/priority")
    user: Text | None = None
    tokenslice: TokensliceOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        drop = {k for k, v in data.items() if k not in cls.model_fields and (
            k in IGNORED_FIELDS or _is_no_op(v, NO_OP_VALUES.get(k, ())))}
        return {k: v for k, v in data.items() if k not in drop} if drop else data


class CompletionRequest(SamplingFields):
    prompt: Text | list[Int] | list[Text] | list[list[Int]]
    echo: bool = False
    max_tokens: NonNegativeInt | None = Field(None, description="0: no generation, only with echo (the prompt "
                                                                "and its logprobs)")
    logprobs: TopLogprobs | None = Field(None, description="log-probabilities of each token and of this many "
                                                               "most likely alternatives (at most 20), from the "
                                                               "model's raw logits")
    best_of: Choices | None = Field(None, description="generate this many per prompt (>= n) and return the n "
                                                          "with the highest cumulative logprob; not with stream")
    prompt_logprobs: TopLogprobs | None = Field(None, description="vLLM's extension: each prompt token's "
                                                                     "logprob and this many alternatives")
    suffix: str | None = Field(None, description="not supported: must be null")


class TextContentPart(_Strict):
    # Other part types carry other fields (image_url, ...): the handler refuses them by `type`.
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: Text | None = None


class FunctionCallIn(_Strict):
    name: Text
    arguments: Text = Field(description="the call's arguments as JSON text")


class ToolCallIn(_Strict):
    """A tool call an assistant message of the conversation made (sent back in the next turn)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's calls")
    tool_call_id: Text | None = Field(None, description="a tool message: the call it answers")


class FunctionDefinition(_Strict):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments; absent: none")
    strict: bool | None = Field(None, description="true or false alike: calls always follow the schema")


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# OpenAI chat fields this server does not implement: accepted as null (their default), and
# refused with a 400 naming them otherwise.
UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call", "reasoning_effort", "modalities", "prediction", "audio",
                           "web_search_options")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = Field(None, description="wins over max_tokens")
    logprobs: bool = Field(False, description="log-probabilities of the generated tokens (raw logits)")
    top_logprobs: TopLogprobs | None = Field(None, description="with logprobs: this many most likely "
                                                                  "alternatives per token (at most 20)")
    tools: list[ChatTool] | None = Field(None, description="functions the model may call (rendered by its "
                                                            "chat template; calls parsed from <tool_call> blocks)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (the default with tools): text or calls; required: at least one call; "
                          "a named function: that call; none: no calls")
    parallel_tool_calls: bool = Field(True, description="false: at most one call")
    functions: Any = Field(None, description="not supported: must be null (use tools)")
    function_call: Any = Field(None, description="not supported: must be null (use tool_choice)")
    reasoning_effort: Any = Field(None, description="not supported: must be null")
    modalities: Any = Field(None, description="not supported: must be null")
    prediction: Any = Field(None, description="not supported: must be null")
    audio: Any = Field(None, description="not supported: must be null")
    web_search_options: Any = Field(None, description="not supported: must be null")
    add_generation_prompt: bool = True


class PriorityUpdate(_Strict):
    """Body of POST /v1/requests/{id}/priority."""

    priority: Hint = Field(description="the request's new priority; lower runs first (--policy priority)")


class TokenizeRequest(_Strict):
    """Body of POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = Field(None, description="must be the served model name; defaults to it")
    prompt: Text | None = Field(None, description="text to tokenize; exactly one of prompt and messages")
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages "
                                                              "(the chat template places them)")
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = Field(None, description="must be the served model name; defaults to it")
    tokens: list[Int]
