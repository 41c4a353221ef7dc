"""Result objects returned by `LLM.generate` and `Client.generate` (vLLM's shapes)."""

from __future__ import annotations

import msgspec

from noria.protocol.client import Logprob


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
