"""POST /v1/embeddings: OpenAI's embeddings endpoint, served by an engine started with
`--runner pooling` (any other engine answers 400 naming its runner).

Each input becomes one `embed` upstream; they run side by side (the scheduler batches them)
and the answer lists them in input order. The first error answers the request and aborts
the inputs still running. `encoding_format: "base64"` gives each vector as the base64 of its
little-endian float32 bytes, as OpenAI's API does.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
from typing import Any, Literal

import msgspec
from aiohttp import web

from noria.frontend.bridge.errors import BadRequest, from_noria
from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.openai_api import (
    LARGE_BODY,
    _error_response,
    _served_model,
    json_response,
    read_body,
)
from noria.frontend.bridge.openai_requests import decode_body
from noria.frontend.bridge.state import BUDGETS, GATEWAY
from noria.frontend.inputs import Prompt, make_embed
from noria.protocol.client import Embed, Embedding
from noria.protocol.errors import NoriaError
from noria.protocol.sampling import Int64

MAX_INPUTS = 2048  # inputs of one request (OpenAI's own cap)
# The engine names the `embed` field at fault; the client sent `input`.
_PARAM_OF = {"prompt": "input", "prompt_token_ids": "input"}


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, strings, token ids or lists of token ids (checked by `inputs_of`: msgspec
    # takes one array type per union).
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None  # cannot change the output: ignored
    # vLLM's extras, as on the other endpoints.
    priority: Int64 = 0
    cache_salt: str | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def inputs_of(value: Any) -> list[Prompt]:
    """OpenAI's four input forms: a string, strings, token ids, lists of token ids."""
    if isinstance(value, str):
        items: list[Prompt] = [value]
    elif not isinstance(value, list) or not value:
        raise BadRequest("input must be a non-empty string, list of strings, list of token ids or list of "
                         "token-id lists", "input")
    elif _token_ids(value):
        items = [list(value)]
    elif all(isinstance(s, str) for s in value):
        items = list(value)
    elif all(_token_ids(ids) for ids in value):
        items = [list(ids) for ids in value]
    else:
        raise BadRequest("input must be a string, a list of strings, a list of token ids or a list of token-id "
                         "lists", "input")
    if len(items) > MAX_INPUTS:
        raise BadRequest(f"at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    if any(not item for item in items):
        raise BadRequest("input must not hold an empty string or an empty token-id list", "input")
    return items


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # array, not numpy: numpy was the bridge's one use of it, ~15 MiB of its RSS. Each value
        # is rounded to float32 as numpy's asarray does (a C cast: nearest, inf past the range).
        floats = array.array("f", vector)
        if sys.byteorder == "big":
            floats.byteswap()
        return base64.b64encode(floats.tobytes()).decode("ascii")
    return vector


async def run_embeds(gateway: Gateway, msgs: list[Embed], param_of: dict[str, str]) -> list[Embedding] | web.Response:
    """Every `embed` of one HTTP request side by side, answers in order; the first error is the
    answer (its `param` renamed to the client's field by `param_of`) and aborts the others."""
    try:
        async with asyncio.TaskGroup() as group:
            # Cancelling the handler (its client hung up) cancels these, which aborts them upstream.
            tasks = [group.create_task(gateway.embed(m)) for m in msgs]
    except ExceptionGroup as eg:
        first = eg.exceptions[0]
        if isinstance(first, NoriaError):
            first.param = param_of.get(first.param or "", first.param)
            return from_noria(first)
        raise first from None
    return [t.result() for t in tasks]


async def handle_embeddings(request: web.Request) -> web.Response:
    app = request.app
    gateway, budgets = app[GATEWAY], app[BUDGETS]
    try:
        body = await read_body(request)
        if isinstance(body, web.Response):
            return body
        if len(body) > LARGE_BODY:  # off the event loop, as the other endpoints do
            req = await asyncio.to_thread(decode_body, body, EmbeddingRequest)
        else:
            req = decode_body(body, EmbeddingRequest)
        inputs = inputs_of(req.input)
        if req.dimensions is not None and req.dimensions < 1:
            raise BadRequest(f"dimensions must be at least 1, got {req.dimensions}", "dimensions")
        model = await _served_model(gateway, req.model)
        who, cost = request.remote or "", len(inputs)
        try:
            budgets.take(who, cost)
        except BadRequest as e:
            e.param = "input" if e.param == "n" else e.param  # one sequence per input
            raise
    except (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError) as e:
        return _error_response(e)
    try:
        msgs = [make_embed(gateway.new_id(), p, dimensions=req.dimensions, priority=req.priority,
                           cache_salt=req.cache_salt) for p in inputs]
        outs = await run_embeds(gateway, msgs, _PARAM_OF)
    finally:
        budgets.give(who, cost)
    if isinstance(outs, web.Response):
        return outs
    tokens = sum(o.usage.prompt_tokens for o in outs)
    data = [EmbeddingData(index=i, embedding=encode(o.embedding, req.encoding_format)) for i, o in enumerate(outs)]
    return json_response(EmbeddingResponse(data=data, model=model,
                                           usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))
