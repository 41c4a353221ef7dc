"""A Responses request → the chat completions fields that /v1/chat/completions would get
for the same conversation, and a finished Response → the chat messages a later
`previous_response_id` continues from.

Input items: a string (one user message) or a list of messages (`role` user, system,
developer or assistant; `content` a string or text parts: `input_text`, `output_text`),
`function_call` items (an assistant's tool call; consecutive calls join one assistant
message, as chat templates expect them), `function_call_output` items (a `tool` message)
and `reasoning` items (accepted and left out of the prompt, as chat templates drop earlier
turns' reasoning). `instructions` becomes the first system message and, as in OpenAI's
API, is not carried to a response that continues this one.
"""

from __future__ import annotations

from typing import Any

from noria.frontend.bridge.chat_translate import chat_function_tool
from noria.frontend.bridge.errors import BadRequest
from noria.frontend.bridge.openai_structured import JsonSchemaFormat, ResponseFormat
from noria.frontend.bridge.responses_schema import (
    OutputItem,
    OutputMessage,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
)
from noria.protocol.errors import ErrorCode

# Responses fields that ask for what noria cannot do: (asks for nothing?, why).
_REFUSED = {
    "top_logprobs": (lambda v: not v, "logprobs are offered on /v1/chat/completions"),
    "max_tool_calls": (lambda v: v is None, "the number of tool calls is not capped"),
    "conversation": (lambda v: v is None, "conversations are not stored; use previous_response_id"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported"),
}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
# Chat completions field names that mean a Responses field: errors name what the client sent.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text"}


def _bad(message: str, param: str, *, shape: bool = True) -> BadRequest:
    return BadRequest(message, param, code=ErrorCode.INVALID_MESSAGE if shape else ErrorCode.INVALID_REQUEST)


def _text_of(content: Any, param: str) -> str:
    """A string, or text parts joined; any other part (images, files, audio) is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"only text content parts are supported, got {kind!r}", param, shape=False)
        text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise _bad("a text content part needs a string `text`", param)
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"a {item.get('type')} item needs a string `{key}`", "input")
    return value


def input_messages(given: str | list[Any] | None) -> list[dict[str, Any]]:
    """The chat messages for `input` (see the module's docstring)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for item in given:
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise _bad(f"a message's role must be one of {sorted(_ROLES)}, got {item.get('role')!r}", "input")
            out.append({"role": role, "content": _text_of(item.get("content"), "input")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id"), "type": "function",
                    "function": {"name": _string(item, "name"), "arguments": _string(item, "arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id"),
                        "content": _text_of(item.get("output"), "input")})
        elif kind != "reasoning":
            raise _bad(f"input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output, reasoning)", "input", shape=False)
    return out


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the assistant's chat message (reasoning left out)."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if not isinstance(item, OutputMessage | ReasoningItem)]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools (`{"type": "function", "name", "description",
    "parameters", "strict"}`) in the chat shape; any other kind of tool is refused."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("tools must be a list of tool objects", "tools")
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise _bad(f"only function tools are supported, got {t.get('type')!r}", "tools", shape=False)
        out.append(chat_function_tool(t.get("name"), t.get("description"), t.get("parameters")))
    return out


def chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # "none", "auto", "required"; anything else is refused by the frontend
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
               "tool_choice", shape=False)


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))


def _text_format(req: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` shapes the answer's message; a tool_choice that forces a call leaves no
    message to shape (so agents that keep one output format on every turn work)."""
    fmt = response_format(req.text)
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    return None if forced and req.tools else fmt


def check_refused(req: ResponsesRequest) -> None:
    for name, (asks_nothing, why) in _REFUSED.items():
        if not asks_nothing(getattr(req, name)):
            raise BadRequest(f"{name} is not supported: {why}", name)
    if req.background and req.stream:
        raise BadRequest("background responses are not streamed: poll GET /v1/responses/{id}", "background")
    if req.background and not req.store:
        raise BadRequest("a background response must be stored (store: true)", "background")


def chat_fields(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(ChatRequest fields, the conversation so far without the instructions: what a later
    response continues from)."""
    check_refused(req)
    conversation = history + input_messages(req.input)
    if not conversation:
        raise BadRequest("input must hold at least one message", "input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _text_format(req),
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "ignore_eos": req.ignore_eos, "priority": req.priority, "cache_salt": req.cache_salt, "guided_json": req.guided_json,
        "guided_regex": req.guided_regex, "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar,
    }
    return fields, conversation
