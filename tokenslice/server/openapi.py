"""The OpenAPI schema: error and streaming responses documented per route, and the request
schemas narrowed to what this server accepts (its model name, its vocabulary)."""
from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from tokenslice.engine.protocol import EngineInfo
from tokenslice.request import MAX_LOGIT_BIAS
from tokenslice.server.protocol import ErrorResponse
from tokenslice.server.settings import ServerSettings


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


def _server_schema(schema: dict[str, Any], settings: ServerSettings, engine: EngineInfo) -> None:
    """What this server accepts beyond the pydantic types: its model name, token ids in its
    vocabulary, non-empty prompts, and the fields it does not support yet at their off
    values (the handlers answer those with a specific 400)."""
    comps = schema["components"]["schemas"]
    token = {"type": "integer", "minimum": 0, "maximum": engine.vocab_size - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        _narrow(props["model"], anyOf=[_model_name_schema(settings.model_names), {"type": "null"}])
        _narrow(props["stop"], anyOf=[{"type": "string", "minLength": 1},
                                      {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}])
        _narrow(props["stop_token_ids"], anyOf=[{"type": "array", "items": token}, {"type": "null"}])
        _narrow(props["logit_bias"], anyOf=[{"type": "object", "propertyNames": {"pattern": "^[0-9]{1,18}$"},
                                             "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                                      "maximum": MAX_LOGIT_BIAS}},
                                            {"type": "null"}])
        if not engine.uses_priority:
            _narrow(props["priority"], type="integer", enum=[0])
    comp = comps["CompletionRequest"]["properties"]
    _narrow(comp["prompt"], anyOf=[
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1}, "minItems": 1}])
    _narrow(comp["suffix"], type="null")
    chat = comps["ChatCompletionRequest"]["properties"]
    _narrow(chat["tools"], anyOf=[{"type": "array", "maxItems": 0}, {"type": "null"}])
    part = comps["TextContentPart"]
    part["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]
    for ops in schema["paths"].values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)  # invalid bodies get 400, as OpenAI answers


def install_openapi(app: FastAPI, settings: ServerSettings, engine: EngineInfo) -> None:
    """The app's schema is FastAPI's, narrowed once by _server_schema."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _server_schema(schema, settings, engine)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
