"""A request's structured-output fields -> the grammar its tokens follow (request.StructuredOutput):
OpenAI's response_format, vLLM's structured_outputs object and its older guided_* fields. One
constraint per request; each is checked here (size, syntax) so that a bad schema is a 400 naming
its field before the request reaches the engine."""
from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool

from tokenslice.request import StructuredOutput
from tokenslice.server.errors import APIError
from tokenslice.server.protocol import MAX_GRAMMAR_CHARS, SamplingFields

async def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The request's grammar, or None for free text; 400 naming the field for a bad or second one.
    The grammar is checked off the event loop: the first check imports xgrammar (and torch)."""
    found = [(param, spec) for param, spec in _asked(body) if spec is not None]
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: only one structured-output constraint per request, and "
                            f"{found[0][0]} is set too", param=found[1][0])
    if not found:
        return None
    param, spec = found[0]
    if len(spec.spec) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{param}: {len(spec.spec)} characters; at most {MAX_GRAMMAR_CHARS} are compiled",
                       param=param)
    await run_in_threadpool(check_grammar, spec, param)
    return spec


def check_grammar(spec: StructuredOutput, param: str) -> None:
    """400 naming `param` for a grammar xgrammar cannot read (checked without the tokenizer: cheap)."""
    from tokenslice.model.grammar import GrammarError, grammar_of

    try:
        grammar_of(spec)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def _asked(body: SamplingFields) -> list[tuple[str, StructuredOutput | None]]:
    rf = body.response_format
    so = body.structured_outputs
    out: list[tuple[str, StructuredOutput | None]] = [("response_format", _response_format(rf) if rf else None)]
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object or None, "structural_tag": so.structural_tag}
        for name, value in fields.items():
            out.append((f"structured_outputs.{name}", _spec(name, value, f"structured_outputs.{name}")))
    out += [("guided_json", _spec("json", body.guided_json, "guided_json")),
            ("guided_regex", _spec("regex", body.guided_regex, "guided_regex")),
            ("guided_choice", _spec("choice", body.guided_choice, "guided_choice")),
            ("guided_grammar", _spec("grammar", body.guided_grammar, "guided_grammar"))]
    return out


def _response_format(rf: Any) -> StructuredOutput | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object")
    if rf.json_schema is None:
        raise APIError(400, "response_format: type json_schema needs a json_schema object",
                       param="response_format")
    schema = rf.json_schema.schema_
    return StructuredOutput("json_schema", json.dumps(schema)) if schema is not None else StructuredOutput("json_object")


def _spec(name: str, value: Any, param: str) -> StructuredOutput | None:
    if value is None:
        return None
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{param}: not valid JSON ({e})", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise APIError(400, f"{param}: a JSON schema is an object", param=param)
        return StructuredOutput("json_schema", json.dumps(value))
    if name == "choice":
        return StructuredOutput("choice", json.dumps(list(value), ensure_ascii=False))
    if name == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(name, value)
