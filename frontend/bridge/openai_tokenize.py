"""POST /tokenize and POST /detokenize with vLLM's shapes: a text (or chat messages as the
chat template renders them) to token ids, and token ids back to text. Each is one `tokenize`
or `detokenize` message upstream, answered by the frontend, which has the tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from noria.frontend.bridge.errors import BadRequest
from noria.frontend.bridge.openai_api import (
    LARGE_BODY,
    _error_response,
    _served_model,
    json_response,
    read_body,
)
from noria.frontend.bridge.openai_requests import _message, decode_body
from noria.frontend.bridge.state import GATEWAY
from noria.protocol.client import Detokenize, Detokenized, Tokenize, Tokenized
from noria.protocol.errors import NoriaError
from noria.protocol.sampling import Int64


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's two request forms in one: `prompt` (a completion's) or `messages` (a chat's)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Int64]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


async def _read(request: web.Request, kind: type[Any]) -> Any:
    """The body decoded as `kind`; raises what `_error_response` answers, or _BodyTimeout."""
    body = await read_body(request)
    if isinstance(body, web.Response):
        raise _BodyTimeout(body)
    if len(body) > LARGE_BODY:  # off the event loop, as the other endpoints do
        return await asyncio.to_thread(decode_body, body, kind)
    return decode_body(body, kind)


class _BodyTimeout(Exception):
    """read_body's 408, carried out of _read to the handler."""

    def __init__(self, resp: web.Response) -> None:
        super().__init__(resp.status)
        self.resp = resp

    def response(self) -> web.Response:
        return self.resp


_INPUT_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError)


async def handle_tokenize(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    try:
        req: TokenizeRequest = await _read(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of prompt, messages", "prompt" if req.prompt is not None else "messages")
        await _served_model(gateway, req.model)
        messages = None if req.messages is None else [_message(m) for m in req.messages]
        msg = Tokenize(request_id=gateway.new_id(), prompt=req.prompt, messages=messages,
                       add_special_tokens=req.add_special_tokens, add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                       chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
                       return_token_strs=req.return_token_strs)
        out = await gateway.client.ask(msg)
    except _BodyTimeout as e:
        return e.response()
    except _INPUT_ERRORS as e:
        return _error_response(e)
    assert isinstance(out, Tokenized)
    return json_response(TokenizeResponse(count=out.count, max_model_len=out.max_model_len, tokens=out.tokens,
                                          token_strs=out.token_strs))


async def handle_detokenize(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    try:
        req: DetokenizeRequest = await _read(request, DetokenizeRequest)
        await _served_model(gateway, req.model)
        out = await gateway.client.ask(Detokenize(request_id=gateway.new_id(), tokens=req.tokens))
    except _BodyTimeout as e:
        return e.response()
    except _INPUT_ERRORS as e:
        return _error_response(e)
    assert isinstance(out, Detokenized)
    return json_response(DetokenizeResponse(prompt=out.prompt))
