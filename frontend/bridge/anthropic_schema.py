"""Anthropic Messages API shapes (`POST /v1/messages`, `/v1/messages/count_tokens`): msgspec
Structs, JSON on the wire.

Unknown request fields are ignored, as Anthropic-compatible servers do. Beside Anthropic's
fields a request may carry a few of vLLM's extras (seed, min_p, the penalties, cache_salt,
priority, chat_template_kwargs, guided_* and structured_outputs), with the chat endpoint's
meanings: the request becomes a chat completions request (anthropic_requests.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from noria.frontend.bridge.openai_structured import ResponseFormat
from noria.protocol.sampling import Int64, Seed
from noria.protocol.structured import StructuredOutput


class _Conversation(msgspec.Struct, kw_only=True):
    """What both endpoints render through the chat template."""

    model: str
    messages: list[dict[str, Any]]  # blocks are read in anthropic_requests (a 400 naming the block)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's user id: cannot change the output
    # vLLM's extras, as on /v1/chat/completions
    seed: Seed | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    priority: Int64 = 0
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutput | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    pass


# The extras copied as they are onto the chat request.
EXTRAS = ("seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "cache_salt", "priority",
          "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


# ---- content blocks -----------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # Anthropic's proof of origin; noria has none to give


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


Block = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct, kw_only=True):
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[Block]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage
    role: str = "assistant"


class TokensCount(msgspec.Struct, kw_only=True):
    input_tokens: int


# ---- stream events (each SSE event's name is its `type`) ---------------------


class TextDelta(msgspec.Struct, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class MessageStart(msgspec.Struct, kw_only=True, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(msgspec.Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Block


class ContentBlockDelta(msgspec.Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, kw_only=True, tag="message_delta", tag_field="type"):
    """`usage` is cumulative: the input counts come here too, as the prompt's length is
    known only once the request is done (message_start says 0)."""

    delta: StopInfo
    usage: Usage


class MessageStop(msgspec.Struct, kw_only=True, tag="message_stop", tag_field="type"):
    pass


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorEvent(msgspec.Struct, kw_only=True, tag="error", tag_field="type"):
    """An error answer's body, and the stream's `error` event."""

    error: ErrorDetail


Event = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorEvent
