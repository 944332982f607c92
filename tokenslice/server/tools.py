"""Tool calling on /v1/chat/completions (OpenAI's `tools`): the checks between a request's tool
fields, the Hermes-style prompt for chat templates that ignore tools, the grammar (an xgrammar
structural tag) that keeps every call well-formed, and the parser that turns the output's
`<tool_call>` blocks back into calls, whole or as a stream arrives.

A call is written as Hermes and Qwen models write it, and as the grammar constrains it:
`<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`."""
from __future__ import annotations

import json
import uuid
from typing import Any

from tokenslice.request import StructuredOutput
from tokenslice.server.errors import APIError
from tokenslice.server.protocol import (MAX_GRAMMAR_CHARS, UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest, ChatTool,
                                        NamedToolChoice, ToolCallIn)
from tokenslice.server.responses import FunctionCallOut, ToolCallOut
from tokenslice.server.structured import check_grammar

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# OpenAI's older names of the tool fields, named in their 400.
REPLACED_BY = {"functions": "tools", "function_call": "tool_choice"}
# Fields that constrain the output with a grammar of their own: one grammar per request.
OTHER_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# At most one whitespace character between JSON tokens of the arguments: a small model may
# otherwise write spaces or newlines forever.
MAX_WHITESPACE = 1

HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{signatures}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def check_tool_fields(body: ChatCompletionRequest) -> None:
    """400 naming the field for OpenAI fields this server does not implement, and for tool fields
    that contradict each other or another output constraint."""
    for name in UNSUPPORTED_CHAT_FIELDS:
        if getattr(body, name) is not None:
            instead = f" (use {REPLACED_BY[name]})" if name in REPLACED_BY else ""
            raise APIError(400, f"{name} is not supported{instead}: send null or leave it out", param=name)
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice other than none needs tools", param="tool_choice")
        return
    names = [t.function.name for t in body.tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: each function needs its own name", param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                       param="tool_choice")
    if choice == "none":
        return
    rf = body.response_format
    other = ["response_format"] if rf is not None and rf.type != "text" else []
    other += [name for name in OTHER_CONSTRAINTS if getattr(body, name) is not None]
    if other:
        raise APIError(400, f"{other[0]} cannot be combined with tools (tool calls follow a grammar of their "
                            f"own) unless tool_choice is none", param=other[0])


def calls_tools(body: ChatCompletionRequest) -> bool:
    """Whether the output may hold calls (parsed out of it): tools given and tool_choice not none."""
    return bool(body.tools) and body.tool_choice != "none"


def tool_grammar(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The structural tag the output follows under the request's tool_choice; None without calls.
    400 naming tools when xgrammar cannot read it (a function's parameters are no JSON schema)."""
    if not calls_tools(body):
        return None
    assert body.tools is not None
    # xgrammar loads torch: imported by the requests that need it, not by the server's start.
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat, TriggeredTagsFormat

    choice = body.tool_choice or "auto"
    once = not body.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        fmt: Any = _call_tag(next(t for t in body.tools if t.function.name == choice.function.name))
    elif choice == "required":  # calls only, no free text: even a small model writes a valid call
        fmt = TagsWithSeparatorFormat(tags=[_call_tag(t) for t in body.tools], separator="\n", at_least_one=True,
                                      stop_after_first=once)
    else:  # auto: free text; a `<tool_call>` begins a constrained call
        fmt = TriggeredTagsFormat(triggers=[CALL_OPEN], tags=[_call_tag(t) for t in body.tools],
                                  stop_after_first=once)
    spec = StructuredOutput("structural_tag", StructuralTag(format=fmt).model_dump_json())
    if len(spec.spec) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"tools: their grammar has {len(spec.spec)} characters; at most {MAX_GRAMMAR_CHARS} "
                            f"are compiled", param="tools")
    check_grammar(spec, "tools")
    return spec


def _call_tag(tool: ChatTool) -> Any:
    """The xgrammar TagFormat of one call of `tool`."""
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

    f = tool.function
    return TagFormat(begin=f'{CALL_OPEN}\n{{"name": "{f.name}", "arguments": ',
                     content=JSONSchemaFormat(json_schema=parameters(tool), max_whitespace_cnt=MAX_WHITESPACE),
                     end="}\n" + CALL_CLOSE)


def parameters(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of a function's arguments; one taking none when it has no `parameters`."""
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def tool_dicts(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates read them (OpenAI's shape, a schema for every function)."""
    out = []
    for t in tools:
        function = t.function.model_dump(exclude_none=True, exclude={"strict"})
        out.append({"type": "function", "function": {**function, "parameters": parameters(t)}})
    return out


def tool_prompt(tools: list[ChatTool]) -> str:
    """The system text that tells a model whose template ignores tools what it may call, and how."""
    return HERMES_PROMPT.format(signatures="\n".join(json.dumps(t) for t in tool_dicts(tools)))


def call_arguments(call: ToolCallIn) -> Any:
    """A call's arguments as templates expect them: the JSON object, else the text as sent."""
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
    return args if isinstance(args, dict) else call.function.arguments


def call_blocks(calls: list[ToolCallIn]) -> str:
    """An assistant's calls written as the model writes them, for templates that know no tool_calls."""
    return "\n".join(f"{CALL_OPEN}\n{json.dumps({'name': c.function.name, 'arguments': call_arguments(c)})}\n"
                     f"{CALL_CLOSE}" for c in calls)


def tool_response(content: str) -> str:
    """A tool's result as Hermes and Qwen templates wrap it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(block: str) -> ToolCallOut | None:
    """The call one `<tool_call>...</tool_call>` block holds; None unless its JSON is {name, arguments}."""
    try:
        # Not strict: the grammar lets a string hold raw control characters; json.dumps escapes them.
        call = json.loads(block[len(CALL_OPEN):-len(CALL_CLOSE)], strict=False)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        return None
    return ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=call["name"],
                                                                  arguments=json.dumps(call["arguments"])))


class ToolCallParser:
    """Splits one choice's text, fed as it arrives, into content and calls. Text that may begin a
    `<tool_call>` is held back until it does or cannot; a block becomes a call once it closes (one
    that does not parse stays content); the content's leading and trailing whitespace is dropped,
    so the streamed content adds up to the whole text's (`parse_tool_calls`)."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet given out: a possible or open block
        self.inside = False  # pending starts with CALL_OPEN
        self.space = ""  # whitespace after the content so far: given out only if more content follows
        self.started = False  # content given out already
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCallOut]:
        """Content pieces and calls, in order, that `text` completes."""
        self.pending += text
        out: list[str | ToolCallOut] = []
        while True:
            if self.inside:
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    return out
                block, self.pending = self.pending[:end + len(CALL_CLOSE)], self.pending[end + len(CALL_CLOSE):]
                self.inside = False
                call = parse_block(block)
                if call is None:
                    self._content(out, block)
                else:
                    self.num_calls += 1
                    out.append(call)
            else:
                start = self.pending.find(CALL_OPEN)
                if start < 0:
                    keep = _open_prefix(self.pending)
                    self._content(out, self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                self._content(out, self.pending[:start])
                self.pending = self.pending[start:]
                self.inside = True

    def finish(self) -> list[str | ToolCallOut]:
        """What is left once the text has ended: a held-back prefix or an unclosed block is content."""
        out: list[str | ToolCallOut] = []
        self._content(out, self.pending)
        self.pending, self.inside = "", False
        return out

    def _content(self, out: list[str | ToolCallOut], text: str) -> None:
        text = self.space + text if self.started else text.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            out.append(body)
            self.started = True


def _open_prefix(text: str) -> int:
    """Length of the longest end of `text` that begins CALL_OPEN (it may become a block)."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """A whole output: its content (text outside the calls, stripped; None if empty) and its calls."""
    parser = ToolCallParser()
    items = parser.feed(text) + parser.finish()
    content = "".join(i for i in items if isinstance(i, str))
    return content or None, [i for i in items if isinstance(i, ToolCallOut)]
