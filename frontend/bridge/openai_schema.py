"""OpenAI-compatible request and response shapes (msgspec Structs, JSON on the wire).

Unknown request fields are ignored, as OpenAI-compatible servers do, so that
clients sending newer fields keep working; fields that would change the
meaning of a request and are not supported are declared in `openai_refused`
and rejected there.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from noria.frontend.bridge.openai_structured import StructuredFields
from noria.protocol.client import ToolCall, ToolCallDelta
from noria.protocol.sampling import Int64, Seed


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(StructuredFields, kw_only=True):  # response_format, guided_*: openai_structured.py
    """Fields shared by both endpoints; the vLLM extras (top_k ... priority) too.

    Integers are 64-bit (`Int64`): a larger one is refused where the body is decoded, naming
    its field, rather than failing to encode on its way upstream."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    priority: Int64 = 0
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None  # vLLM's: different salts never share prefix-cache blocks
    # vLLM's prefill/decode disaggregation (protocol/kv_transfer.py), one prompt only.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: logprob tokens spelled "token_id:ID" instead of their text (a client that cannot
    # take the text, or wants the ids).
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # str, list of str, list of token ids, or list of token-id lists: checked in openai_api
    prompt: str | list[Any]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM's: refused (see chat_generate)
    # OpenAI's tool calling, checked by the frontend (frontend/tools.py); `tools` and
    # `tool_choice` are declared in RefusedFields, which /v1/completions still refuses.
    parallel_tool_calls: bool | None = None
    # vLLM's chat template controls, passed on in `generate` (docs/protocol.md)
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# ---- /v1/completions ----------------------------------------------------


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    """A whole response, or (with `stream`) one chunk of one: OpenAI uses one shape for both."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a producer's answer


# ---- /v1/chat/completions -----------------------------------------------


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class ChatMessage(msgspec.Struct, kw_only=True):
    content: str | None
    role: str = "assistant"
    # Left out of the answer unless given (UNSET), as OpenAI leaves them out.
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a producer's answer


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: UsageInfo | None = None


# ---- /v1/models and errors ----------------------------------------------


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "noria"
    # vLLM's lineage fields: `root` the checkpoint, `parent` the base model of an adapter
    # (null: this is a base model; routers group engines by it).
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


class Health(msgspec.Struct, kw_only=True):
    status: str
    engine: str
    model: str | None = None
    reason: str | None = None  # why the status is not "ok"
    # The worker group's attention backend (--attention-backend) and why not the kernels, if so.
    attention_backend: str | None = None
    attention_reason: str | None = None
