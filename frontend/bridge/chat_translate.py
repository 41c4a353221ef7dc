"""Helpers for APIs that are served by translating them into a chat completions request
(OpenAI's Responses, Anthropic's Messages): one `Generate` made exactly as
/v1/chat/completions makes it, and each upstream `Delta` split into ordered pieces.

Building a `ChatRequest` and handing it to `chat_generate` means every check the chat
endpoint runs (sampling ranges, refused fields, tools, structured output) runs here too,
with the same errors; only the field names a client sent differ, so callers map `param`s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from noria.frontend.bridge.openai_requests import chat_generate
from noria.frontend.bridge.openai_schema import ChatRequest
from noria.protocol.client import Delta, Done, Generate, ToolCall

PieceKind = Literal["reasoning", "text", "call", "arguments"]


def chat_generate_for(chat: dict[str, Any], new_id: Callable[[], str]) -> Generate:
    """The upstream message for chat completions fields `chat` (ChatRequest's names:
    `messages`, `tools` in the chat shape, `tool_choice`, `response_format`,
    `max_completion_tokens`, `temperature`, ...). Raises what chat_generate raises."""
    return chat_generate(ChatRequest(**chat), new_id)


def chat_function_tool(name: Any, description: Any = None, parameters: Any = None) -> dict[str, Any]:
    """A tool in the chat completions shape (`{"type": "function", "function": {...}}`);
    the frontend checks the name and the schema, as it does for chat."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class Piece:
    """One ordered piece of a sample's output. `call`: a tool call starts (`index`, `call_id`,
    `name`); `arguments`: more of call `index`'s arguments; else reasoning or content text."""

    kind: PieceKind
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


def pieces(d: Delta) -> list[Piece]:
    """A delta's output in the order the model wrote it: reasoning comes before content, and
    the parsers hand content out before the calls that follow it."""
    out: list[Piece] = []
    if d.reasoning_content:
        out.append(Piece("reasoning", d.reasoning_content))
    if d.text:
        out.append(Piece("text", d.text))
    for tc in d.tool_calls or ():
        fn = tc.function
        if tc.id is not None:
            out.append(Piece("call", index=tc.index, call_id=tc.id, name=(fn.name if fn else None) or ""))
        if fn is not None and fn.arguments:
            out.append(Piece("arguments", fn.arguments, index=tc.index))
    return out


@dataclass
class ChatOutcome:
    """What a one-sample chat request produced, once its `Done` came."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, ev: Delta | Done) -> list[Piece]:
        if isinstance(ev, Done):
            self.finish_reason = ev.finish_reason
            self.prompt_tokens = ev.usage.prompt_tokens
            self.completion_tokens = ev.usage.completion_tokens
            self.cached_tokens = ev.usage.cached_tokens
            self.calls = list((ev.tool_calls or [[]])[0])
            return []
        if ev.text:
            self.text.append(ev.text)
        if ev.reasoning_content:
            self.reasoning.append(ev.reasoning_content)
        return pieces(ev)
