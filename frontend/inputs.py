"""The one way a `generate` message is made from SamplingParams and a prompt
(used by `LLM`, the client library and the OpenAI bridge)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from noria.protocol.client import Embed, Generate
from noria.protocol.sampling import SamplingParams

Prompt = str | list[int]


def make_generate(
    request_id: str,
    prompt: Prompt | None = None,
    params: SamplingParams | None = None,
    *,
    messages: list[dict[str, Any]] | None = None,
    priority: int = 0,
    add_generation_prompt: bool = True,
    cache_salt: str | None = None,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool = True,
) -> Generate:
    """A text prompt, a token-id prompt or chat `messages` (give one), with every
    SamplingParams field laid flat beside the request's own fields. The chat template
    controls and OpenAI's tool fields apply to `messages` (docs/protocol.md, `generate`)."""
    # No params: the fields a request may leave to the server (GENERATION_DEFAULT_FIELDS) stay
    # unset and take its defaults (--generation-config); a SamplingParams sets every field, its
    # defaults included, as vLLM's does.
    fields = {} if params is None else msgspec.structs.asdict(params)
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif prompt is not None:
        fields["prompt_token_ids"] = list(prompt)
    return Generate(request_id=request_id, messages=messages, priority=priority,
                    add_generation_prompt=add_generation_prompt, cache_salt=cache_salt,
                    continue_final_message=continue_final_message, chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs, tools=tools, tool_choice=tool_choice,
                    parallel_tool_calls=parallel_tool_calls, **fields)


def prompt_list(inputs: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """What `generate` and `embed` take, as a list of inputs: a text, token ids, or a list of
    either."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and isinstance(items[0], int):
        return [items]  # one input given as token ids
    return items


def make_embed(request_id: str, prompt: Prompt, *, dimensions: int | None = None, priority: int = 0,
               cache_salt: str | None = None) -> Embed:
    """An `embed` message for a text or a token-id input."""
    if isinstance(prompt, str):
        return Embed(request_id=request_id, prompt=prompt, dimensions=dimensions, priority=priority,
                     cache_salt=cache_salt)
    return Embed(request_id=request_id, prompt_token_ids=list(prompt), dimensions=dimensions, priority=priority,
                 cache_salt=cache_salt)
