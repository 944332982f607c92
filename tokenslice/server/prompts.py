"""Prompts and chat messages -> the token ids the engine runs, refusing what cannot fit the
model's context before spending tokenizer time on it."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

from tokenslice.engine.protocol import EngineClient
from tokenslice.request import InvalidRequestError
from tokenslice.server.errors import APIError
from tokenslice.server.protocol import ChatMessage, ChatTool
from tokenslice.server.tools import call_arguments, call_blocks, tool_dicts, tool_prompt, tool_response


# A --chat-template value with one of these is a template, not a file name (as vLLM decides).
JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a template (it has a
    brace or a newline; escapes such as \\n are decoded, as vLLM does). ValueError when it looks
    like a file name that cannot be read, or does not parse as Jinja."""
    if value is None:
        return None
    try:
        text = Path(value).read_text()
    except (OSError, ValueError) as e:
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file name, but it cannot be read: "
                             f"{getattr(e, 'strerror', None) or e}") from None
        # Escapes typed on a command line (\n) become the characters; other text stays as it is.
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return text


class PromptTokenizer:
    """Tokenizes completion prompts (as the engine does) and renders chats through the chat
    template: `chat_template` (--chat-template) when given, else the model's own."""

    def __init__(self, engine: EngineClient, served_model_name: str, chat_template: str | None = None) -> None:
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.chat_template = chat_template

    @property
    def template(self) -> str | None:
        """The chat template in use: --chat-template's, else the tokenizer's, else None."""
        return self.chat_template or getattr(self.tokenizer, "chat_template", None) or None

    def check_room(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        """An explicit output limit must fit the context after the prompt, as vLLM checks it; a
        prompt that leaves no room at all is the engine's error (param "prompt")."""
        limit = self.info.max_model_len
        if max_tokens is not None and len(ids) < limit and len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's context is {limit} tokens, but {len(ids) + max_tokens} were requested "
                                f"({len(ids)} in the prompt, {max_tokens} for the completion); lower {param} to at "
                                f"most {limit - len(ids)} or shorten the prompt", param=param)

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """More characters than this cannot fit the context whatever the tokenizer does.

        Tokenizing a body-limit-sized prompt takes seconds of CPU; this refuses hopeless ones
        first. No token spells more characters than its longest vocabulary entry; the factor 4
        leaves room for normalizers that merge characters."""
        tok = self.tokenizer
        if tok is None:
            return None
        longest = max((len(t) for t in tok.get_vocab()), default=1)
        return self.info.max_model_len * max(1, longest) * 4

    def _check_length(self, text: str, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"{param} has {len(text)} characters, more than this model's context of "
                                f"{self.info.max_model_len} tokens can hold", param=param)

    def tokenize_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self._check_length(prompt, "prompt")
        tok = self.tokenizer
        if not add_special_tokens and tok is not None:  # /tokenize only: the engine always adds them
            return list(tok(prompt, add_special_tokens=False)["input_ids"])
        try:
            return self.engine.tokenize(prompt)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False, tools: list[ChatTool] | None = None) -> list[int]:
        """Messages (and the tools the model may call) -> token ids through the chat template."""
        tok = self.tokenizer
        if tok is None or self.template is None:
            raise APIError(400, f"model {self.served_model_name!r} has no chat template, so it cannot "
                                "serve /v1/chat/completions; use /v1/completions with a plain prompt, or start "
                                "the server with --chat-template", param="messages", code="chat_template_missing")
        text = render_conversation(tok, self.template, messages, add_generation_prompt, tools)
        self._check_length(text, "messages")
        # The template already places any special tokens (BOS) it wants.
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def render_conversation(tok: Any, template: str | dict[str, str], messages: list[ChatMessage],
                        add_generation_prompt: bool, tools: list[ChatTool] | None = None) -> str:
    """The chat's text. Tools, an assistant's tool_calls and tool results go to the template when
    it reads them; else they are written into the messages as Hermes models read them (the tools
    after the system message, calls as `<tool_call>` blocks, results as `<tool_response>` blocks).
    When the template refuses or leaves out a tool result or the tools (it may know only some
    roles), the chat is rendered again plainer: results as user messages, the tools opening the
    first user message; if that still loses one, a 400. No message is dropped silently."""
    native_calls = _mentions(template, "tool_calls")
    native_tools = bool(tools) and _mentions(template, "tools")
    options = {"tools": tool_dicts(tools)} if tools and native_tools else {}
    prompt = tool_prompt(tools) if tools and not native_tools else None
    for plain in (False, True):
        conversation, needed = _conversation(messages, native_calls, prompt, plain)
        try:
            text = _apply(tok, template, conversation, add_generation_prompt, options)
        except APIError:
            if plain or not needed:
                raise
            continue
        if all(n in text for n in needed):
            return text
    raise APIError(400, "the chat template leaves out tool results or the tools' description, even as user "
                        "messages", param="messages")


def _conversation(messages: list[ChatMessage], native_calls: bool, prompt: str | None,
                  plain: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as the template reads them, and the texts the rendering must hold (each tool
    result, the tools' prompt). `plain`: results as user messages, the prompt in the first one."""
    conversation = [_entry(m, i, native_calls and not plain) for i, m in enumerate(messages)]
    needed = [e["content"].strip() for e in conversation if e["role"] == "tool"]
    if plain:
        for e in conversation:
            e["role"] = "user" if e["role"] == "tool" else e["role"]
    if prompt is not None:
        needed.append(prompt)
        first_user = next((e for e in conversation if e["role"] == "user"), None)
        if plain and first_user is not None:
            first_user["content"] = f"{prompt}\n\n{first_user['content']}"
        elif conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
    return conversation, needed


def _apply(tok: Any, template: str | dict[str, str], conversation: list[dict[str, Any]], add_generation_prompt: bool,
           options: dict[str, Any]) -> str:
    try:
        return tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **options)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None


def _mentions(template: str | dict[str, str], word: str) -> bool:
    """Whether the template reads `word` (a variable or key): a template that never names `tools`
    ignores them."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any(word in t for t in texts)


def _entry(m: ChatMessage, i: int, native_calls: bool) -> dict[str, Any]:
    """Message i as the template reads it."""
    if m.tool_calls is not None and m.role != "assistant":
        raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
    if m.tool_call_id is not None and m.role != "tool":
        raise APIError(400, f"messages[{i}]: only tool messages carry tool_call_id", param="messages")
    entry: dict[str, Any] = {"role": m.role, "content": _message_text(m, i)}
    if m.name is not None:
        entry["name"] = m.name
    if m.tool_calls and native_calls:
        entry["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": call_arguments(c)}}
                               for c in m.tool_calls]
    elif m.tool_calls:
        entry["content"] = "\n".join(t for t in (entry["content"], call_blocks(m.tool_calls)) if t)
    if m.role == "tool" and native_calls:
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
    elif m.role == "tool":
        entry["content"] = tool_response(entry["content"])
    return entry


def message_text(messages: list[ChatMessage]) -> str:
    """The conversation in the client's words, no template: what the embedding length predictor
    reads (it was seeded with prompts, not with a model's chat rendering)."""
    return "\n".join(t for i, m in enumerate(messages) if (t := _message_text(m, i)))


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                           param="messages")
        parts.append(part.text)
    return "".join(parts)
