"""OpenAI (and vLLM) request fields that noria cannot honour and that would change what a
request means: a client sending them gets a 400 naming the field instead of an answer
that silently ignored them. A field counts only when it asks for something: an empty
tool list or `tool_choice: "none"` asks for nothing and passes.

Fields that cannot change the output (`user`, `metadata`, `store`, `service_tier`,
`prediction`) and unknown fields are ignored, as
OpenAI-compatible servers do; docs/protocol.md keeps both lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec


class RefusedFields(msgspec.Struct, kw_only=True):
    """Declared so that they are seen at all (msgspec drops fields it does not know)."""

    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    # vLLM's extras that noria does not implement
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _text_only(value: Any) -> bool:
    return _absent(value) or value == ["text"]


# field -> (does this value ask for nothing?, why it is refused)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_absent, "tool calling is offered on /v1/chat/completions only"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calling is offered on /v1/chat/completions only"),
    "functions": (_absent, "function calling is not supported"),
    "function_call": (lambda v: v is None or v == "none", "function calling is not supported"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (_text_only, "only the text modality is supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "reasoning_effort": (_absent, "the served model is not a reasoning model"),
    "use_beam_search": (_absent, "beam search is not supported"),
    "include_stop_str_in_output": (_absent, "stop strings are never included in the output"),
    "prompt_logprobs": (_absent, "prompt logprobs come with `echo: true` and `logprobs` on /v1/completions"),
    "truncate_prompt_tokens": (_absent, "prompts are never truncated"),
}


def unsupported_field(req: RefusedFields, accepted: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """(field, message) for the first field that asks for what noria cannot do, else None;
    `accepted`: fields this endpoint honours (chat completions: tools, tool_choice)."""
    for name, (asks_nothing, why) in _RULES.items():
        if name not in accepted and not asks_nothing(getattr(req, name)):
            return name, f"{name} is not supported: {why}"
    return None
