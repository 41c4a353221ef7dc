"""An Anthropic request → the chat completions request it means → noria's `generate` (or
`tokenize` for count_tokens), so that both endpoints run the same checks, chat template,
tool calling and reasoning.

* `system` → a first system message; text blocks join as the chat endpoint joins text parts.
* An assistant's `tool_use` blocks → its `tool_calls` (the input as JSON arguments), its
  `thinking` → `reasoning_content` (templates that replay reasoning read it); a user's
  `tool_result` blocks → `tool` messages, before the user's text.
* `tools` (`name`, `description`, `input_schema`) → functions; `tool_choice` auto / any /
  tool / none → "auto" / "required" / a named function / "none", and
  `disable_parallel_tool_use` → `parallel_tool_calls: false`.
* `thinking` enabled / disabled → `chat_template_kwargs.enable_thinking` (the template and
  the reasoning parser read it); `budget_tokens` bounds nothing apart: `max_tokens` bounds
  thinking and answer together, as Anthropic counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from noria.frontend.bridge.anthropic_schema import EXTRAS, CountTokensRequest, MessagesRequest
from noria.frontend.bridge.errors import BadRequest
from noria.frontend.bridge.openai_requests import chat_generate
from noria.frontend.bridge.openai_schema import ChatRequest
from noria.protocol.client import Generate, Tokenize
from noria.protocol.errors import ErrorCode

# The chat request's field → the Anthropic field a client sent, for the errors' `param`.
_NAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}


def messages_generate(req: MessagesRequest, new_id: Callable[[], str]) -> Generate:
    tools, choice, parallel = _tools(req.tools, req.tool_choice)
    chat = ChatRequest(
        model=req.model, messages=chat_messages(req.system, req.messages), max_tokens=req.max_tokens,
        stream=req.stream, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs(req.thinking, req.chat_template_kwargs),
        **{name: getattr(req, name) for name in EXTRAS},
    )
    try:
        return chat_generate(chat, new_id)
    except BadRequest as e:
        e.param = _NAMES.get(e.param or "", e.param)
        raise


def count_tokens_message(req: CountTokensRequest, new_id: Callable[[], str]) -> Tokenize:
    """The prompt a `messages_generate` of the same conversation renders, as a `tokenize`."""
    tools, _, _ = _tools(req.tools, req.tool_choice)
    return Tokenize(request_id=new_id(), messages=chat_messages(req.system, req.messages), tools=tools,
                    chat_template_kwargs=template_kwargs(req.thinking, req.chat_template_kwargs))


def template_kwargs(thinking: dict[str, Any] | None, own: dict[str, Any] | None) -> dict[str, Any] | None:
    if thinking is None:
        return own
    kind = thinking.get("type")
    if kind not in _THINKING:
        raise BadRequest(f"thinking.type must be one of {', '.join(_THINKING)}, got {kind!r}", "thinking")
    return {**(own or {}), "enable_thinking": _THINKING[kind]}


def _tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None
           ) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None, bool | None]:
    """OpenAI's tools, tool_choice and parallel_tool_calls; names and schemas are checked
    by the frontend, as for the chat endpoint."""
    functions = None
    if tools is not None:
        functions = []
        for i, tool in enumerate(tools):
            if tool.get("type", "custom") != "custom":
                raise BadRequest(f"tools[{i}]: server tool {tool.get('type')!r} is not supported; give custom tools "
                                 "(name, description, input_schema)", "tools")
            fn: dict[str, Any] = {"name": tool.get("name")}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            if tool.get("input_schema") is not None:
                fn["parameters"] = tool["input_schema"]
            functions.append({"type": "function", "function": fn})
    if choice is None:
        return functions, None, None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice of type tool needs the tool's name", "tool_choice")
        picked: str | dict[str, Any] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _CHOICES:
        picked = _CHOICES[kind]
    else:
        raise BadRequest(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")
    return functions, picked, not choice.get("disable_parallel_tool_use", False)


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": system if isinstance(system, str) else _texts(system, "system")})
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be \"user\" or \"assistant\", got {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(role, content, i))
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    return out


def _blocks(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat messages: a user's tool results each become a
    `tool` message (before its text), an assistant's calls and reasoning ride on its message."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(b, where))
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise BadRequest(f"{where}: a tool_result needs its tool_use_id", "messages")
            content = b.get("content")
            text = content if isinstance(content, str) else _texts(content or [], "messages", where)
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            raise BadRequest(f"{where}: a {role}'s {kind!r} block is not supported here (text, tool_use, "
                             "tool_result and thinking blocks are)", "messages")
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return [msg]


def _call(b: dict[str, Any], where: str) -> dict[str, Any]:
    if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
        raise BadRequest(f"{where}: a tool_use needs an id, a name and an input object", "messages")
    try:
        arguments = msgspec.json.encode(b["input"]).decode()
    except (TypeError, RecursionError, msgspec.EncodeError):
        raise BadRequest(f"{where}: the tool_use input cannot be written as JSON", "messages",
                         code=ErrorCode.INVALID_MESSAGE) from None
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": arguments}}


def _texts(blocks: Any, param: str, where: str | None = None) -> str:
    """Text blocks joined; anything else is refused (noria's models read text)."""
    where = where or param
    if not isinstance(blocks, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", param)
    texts = []
    for b in blocks:
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise BadRequest(f"{where}: only text blocks are supported, got {kind!r}", param)
        texts.append(b["text"])
    return "".join(texts)
