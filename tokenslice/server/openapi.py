"""The OpenAPI schema: error and streaming responses documented per route, and the request
schemas narrowed to what this server accepts (its model name, its vocabulary and context, the
rules between fields), so that a request the schema allows is not refused for its shape."""
from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from tokenslice.engine.protocol import EngineInfo
from tokenslice.request import MAX_LOGIT_BIAS
from tokenslice.server.protocol import SEED_MAX, SEED_MIN, UNSUPPORTED_CHAT_FIELDS
from tokenslice.server.responses import ErrorResponse
from tokenslice.server.settings import ServerSettings
from tokenslice.server.tools import OTHER_CONSTRAINTS


def error_docs() -> dict[int | str, dict[str, Any]]:
    """The error answers every API route may give."""
    # Built per app: FastAPI keeps references into these while generating the schema.
    return {
        400: {"model": ErrorResponse, "description": "Invalid request"},
        401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
        404: {"model": ErrorResponse, "description": "No such model (code model_not_found)"},
        413: {"model": ErrorResponse, "description": "Request body too large"},
        429: {"model": ErrorResponse, "description": "Too many requests waiting; see Retry-After"},
        500: {"model": ErrorResponse, "description": "Engine fault"},
        503: {"model": ErrorResponse, "description": "Engine not running"},
    }


def ok_doc(model: type, what: str) -> dict[int | str, dict[str, Any]]:
    """A generation route's 200: the JSON object, or server-sent events when stream is true."""
    # One server-sent event as SSE-aware tools read it: `data` is a JSON chunk (the stream
    # object's shape) or the final "[DONE]".
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                            "id": {"type": "string"}, "retry": {"type": "integer"}}}
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}},
                  "description": f"{what}, or server-sent events (each `data` a JSON chunk, then "
                                 f"[DONE]) when stream is true"}}


def _narrow(prop: dict[str, Any], **schema: Any) -> None:
    """Replace a property's type information, keeping its title, description and default."""
    for key in ("type", "anyOf", "minimum", "maximum", "items"):
        prop.pop(key, None)
    prop.update(schema)


def _model_name_schema(names: tuple[str, ...]) -> dict[str, Any]:
    # The served name defaults to --model, which may be a directory: the public schema must not
    # show where the weights live, so path-like names are documented as a plain string.
    if any(os.sep in name or "/" in name or os.path.exists(name) for name in names):
        return {"type": "string"}
    return {"type": "string", "enum": list(names)}


def _decimal_at_most(top: int) -> str:
    """A regex of the decimal numbers 0..top (no leading zeros): logit_bias keys in the vocabulary."""
    digits = str(top)
    alts = ["[0-9]"] if len(digits) > 1 else []
    alts += [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, len(digits))]
    for i, d in enumerate(digits):  # as long as top: its first i digits, then a smaller one
        low = "1" if i == 0 and len(digits) > 1 else "0"
        if d > low:
            below = low if int(d) - 1 == int(low) else f"[{low}-{int(d) - 1}]"
            rest = len(digits) - i - 1
            alts.append(f"{digits[:i]}{below}" + (f"[0-9]{{{rest}}}" if rest else ""))
    alts.append(digits)
    return f"^({'|'.join(alts)})$"


def _sends(prop: str, value: Any) -> dict[str, Any]:
    """The body sends `prop` with this value."""
    return {"required": [prop], "properties": {prop: {"const": value}}}


def _leaves_out(prop: str) -> dict[str, Any]:
    """The body leaves `prop` out or sends null (its default)."""
    return {"properties": {prop: {"type": "null"}}}


def _isnt(prop: str, value: Any) -> dict[str, Any]:
    """The body leaves `prop` out or sends another value."""
    return {"properties": {prop: {"not": {"const": value}}}}


def _require(component: dict[str, Any], why: str, *alternatives: dict[str, Any]) -> None:
    """A rule between fields that a handler checks (a 400 naming the field): one of the
    alternatives must hold."""
    component.setdefault("allOf", []).append({"description": why, "anyOf": list(alternatives)})


def _nullable(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [schema, {"type": "null"}]


def _server_schema(schema: dict[str, Any], settings: ServerSettings, engine: EngineInfo) -> None:
    """What this server accepts beyond the pydantic types: its model name, token ids in its
    vocabulary, non-empty prompts and output limits that fit the context, the rules between fields
    that the handlers check, and the fields it does not support yet at their off values (the
    handlers answer those with a specific 400). A body the schema allows is not refused for its
    shape; what JSON Schema cannot say is still a 400: how many tokens a text makes, and one field
    bounded by another (min_tokens <= max_tokens, best_of >= n)."""
    comps = schema["components"]["schemas"]
    model_name = _model_name_schema(settings.model_names)
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        _narrow(comps[name]["properties"]["model"], anyOf=_nullable(model_name))
    for param in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        if param["name"] == "model_id":
            param["schema"] = {**model_name, "title": param["schema"].get("title", "Model Id")}
    _generation_schemas(comps, settings, engine)
    _tokenizer_schemas(comps, engine)
    if not engine.uses_priority:  # other policies refuse any priority but 0
        _narrow(comps["PriorityUpdate"]["properties"]["priority"], type="integer", enum=[0])
    for ops in schema["paths"].values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)  # invalid bodies get 400, as OpenAI answers


def _generation_schemas(comps: dict[str, Any], settings: ServerSettings, engine: EngineInfo) -> None:
    """CompletionRequest and ChatCompletionRequest (and the content parts of chat messages)."""
    token = {"type": "integer", "minimum": 0, "maximum": engine.vocab_size - 1}
    # A prompt has at least one token: no request can generate more than this.
    room = {"type": "integer", "minimum": 1, "maximum": engine.max_model_len - 1}
    token_prompt = {"type": "array", "items": token, "minItems": 1, "maxItems": engine.max_model_len - 1}
    top_logprobs = {"type": "integer", "minimum": 0, "maximum": settings.max_logprobs}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        _narrow(props["stop"], anyOf=[{"type": "string", "minLength": 1},
                                      {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}])
        _narrow(props["stop_token_ids"], anyOf=_nullable({"type": "array", "items": token}))
        _narrow(props["logit_bias"], anyOf=_nullable({
            "type": "object", "propertyNames": {"pattern": _decimal_at_most(engine.vocab_size - 1)},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}}))
        # FastAPI writes bounds as floats: 2**64 - 1 would read as 2**64, which the server refuses.
        _narrow(props["seed"], anyOf=_nullable({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}))
        _narrow(props["min_tokens"], anyOf=_nullable({**room, "minimum": 0}))
        if not engine.uses_priority:
            _narrow(props["priority"], anyOf=_nullable({"type": "integer", "enum": [0]}))
        _require(comps[name], "stream_options only with stream: true",
                 _leaves_out("stream_options"), _sends("stream", True))
    comp = comps["CompletionRequest"]
    props = comp["properties"]
    prompts = {"type": "array", "minItems": 1, "maxItems": settings.max_prompts_per_request}
    _narrow(props["prompt"], anyOf=[
        {"type": "string", "minLength": 1},
        token_prompt,
        {**prompts, "items": {"type": "string", "minLength": 1}},
        {**prompts, "items": token_prompt}])
    _narrow(props["max_tokens"], anyOf=_nullable({**room, "minimum": 0}))
    _narrow(props["suffix"], type="null")
    for field in ("logprobs", "prompt_logprobs"):
        _narrow(props[field], anyOf=_nullable(top_logprobs))
    _require(comp, "max_tokens 0 only with echo: true (the prompt and its logprobs)",
             _isnt("max_tokens", 0), _sends("echo", True))
    _require(comp, "prompt_logprobs streamed only with echo: true",
             _isnt("stream", True), _leaves_out("prompt_logprobs"), _sends("echo", True))
    chat = comps["ChatCompletionRequest"]
    props = chat["properties"]
    for field in ("max_tokens", "max_completion_tokens"):
        _narrow(props[field], anyOf=_nullable(room))
    _narrow(props["top_logprobs"], anyOf=_nullable(top_logprobs))
    _require(chat, "top_logprobs only with logprobs: true", _leaves_out("top_logprobs"), _sends("logprobs", True))
    _tool_schemas(comps)
    part = comps["TextContentPart"]
    part["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]


def _tool_schemas(comps: dict[str, Any]) -> None:
    """The tool fields of ChatCompletionRequest and ChatMessage: OpenAI's fields this server does
    not implement only as null, and the rules between fields that server/tools.py checks. Not said
    here (a 400 naming the field): a named tool_choice must name one of the tools, their names must
    differ, and each function's parameters must be a JSON schema xgrammar compiles."""
    chat = comps["ChatCompletionRequest"]
    props = chat["properties"]
    for field in UNSUPPORTED_CHAT_FIELDS:
        _narrow(props[field], type="null")
    no_tools = {"properties": {"tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}
    some_tools = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    _require(chat, "tool_choice other than none only with tools", _leaves_out("tool_choice"),
             _sends("tool_choice", "none"), some_tools)
    text_only = {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}
    _require(chat, "tool calls follow their own grammar: no other output constraint with tools, unless "
                   "tool_choice is none", no_tools, _sends("tool_choice", "none"),
             {"properties": {"response_format": text_only, **{f: {"type": "null"} for f in OTHER_CONSTRAINTS}}})
    message = comps["ChatMessage"]
    _require(message, "tool_calls only on assistant messages", _leaves_out("tool_calls"), _sends("role", "assistant"))
    _require(message, "tool_call_id only on tool messages", _leaves_out("tool_call_id"), _sends("role", "tool"))


def _tokenizer_schemas(comps: dict[str, Any], engine: EngineInfo) -> None:
    """TokenizeRequest and DetokenizeRequest."""
    tokenize = comps["TokenizeRequest"]
    _narrow(tokenize["properties"]["prompt"], anyOf=_nullable({"type": "string", "minLength": 1}))
    # Exactly one of prompt and messages (a null one counts as left out).
    tokenize["oneOf"] = [{"required": [one], "properties": {one: {"not": {"type": "null"}}, other: {"type": "null"}}}
                         for one, other in (("prompt", "messages"), ("messages", "prompt"))]
    _narrow(comps["DetokenizeRequest"]["properties"]["tokens"], type="array",
            items={"type": "integer", "minimum": 0, "maximum": engine.vocab_size - 1})


def install_openapi(app: FastAPI, settings: ServerSettings, engine: EngineInfo) -> None:
    """The app's schema is FastAPI's, narrowed once by _server_schema."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _server_schema(schema, settings, engine)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
