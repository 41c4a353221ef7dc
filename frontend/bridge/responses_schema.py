"""OpenAI Responses API shapes (`POST /v1/responses`), field for field as the `openai`
package's `openai.types.responses` names them; msgspec Structs, JSON on the wire.

Unknown request fields are ignored (newer clients keep working); the ones that would
change what a request means and that noria cannot honour are refused in responses_requests.
"""

from __future__ import annotations

from typing import Any

import msgspec

from noria.protocol.sampling import Int64, Seed


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: `{"type": "text" | "json_object" | "json_schema", ...}`; a json_schema's
    fields sit beside its type (unlike chat's `response_format.json_schema`)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: Any = None  # shapes checked in responses_requests, meanings by the frontend
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    # Accepted, and changing nothing: the reasoning parser is the server's (--reasoning-parser).
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    # Refused when they ask for something (responses_requests.REFUSED).
    top_logprobs: Any = None
    max_tool_calls: Any = None
    conversation: Any = None
    prompt: Any = None
    # vLLM's extras, as on chat completions.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# ---- the Response object ---------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, kw_only=True):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"
    type: str = "reasoning"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: str  # completed, incomplete, failed, in_progress, queued, cancelled
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    completed_at: int | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response.deleted"
    deleted: bool = True
