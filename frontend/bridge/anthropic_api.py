"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Each request becomes the chat completions request it means (anthropic_requests.py) and runs
as one: the same per-client budget, body limits and timeouts, slow-reader bound, metrics and
abort on hang-up. Its answer is built by anthropic_events.py; errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, on these paths whoever answers (the
`anthropic_errors` middleware reshapes the app's own: 401, 404, 405, 413, 500).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from noria.frontend.bridge.anthropic_events import MessageBuilder, error_event
from noria.frontend.bridge.anthropic_requests import count_tokens_message, messages_generate
from noria.frontend.bridge.anthropic_schema import (
    CountTokensRequest,
    ErrorDetail,
    ErrorEvent,
    MessagesRequest,
    TokensCount,
)
from noria.frontend.bridge.errors import (
    RETRY_AFTER,
    UNDECODABLE,
    BadRequest,
    status_of,
    undecodable_message,
)
from noria.frontend.bridge.fanout import Fanout
from noria.frontend.bridge.limits import STREAM_STALL
from noria.frontend.bridge.openai_api import (
    LARGE_BODY,
    _served_model,
    _slow_reader,
    json_response,
    read_body,
)
from noria.frontend.bridge.openai_requests import decode_body
from noria.frontend.bridge.state import BUDGETS, GATEWAY, LIMITS
from noria.protocol.client import Tokenized
from noria.protocol.errors import NoriaError

log = logging.getLogger("noria.bridge")
PATH = "/v1/messages"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Anthropic's error types by HTTP status (its documented set; 408 and 503 keep noria's statuses).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error"}
_INPUT_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError)


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str, param: str | None = None) -> web.Response:
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    headers = {"Retry-After": str(RETRY_AFTER)} if status == 429 else None
    body = msgspec.json.encode(ErrorEvent(error=ErrorDetail(type=error_type(status), message=message)))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _answer(e: Exception) -> web.Response:
    if isinstance(e, BadRequest):
        return anthropic_error(e.status, e.message, e.param)
    if isinstance(e, NoriaError):
        return anthropic_error(status_of(e.code), e.message, e.param)
    if isinstance(e, msgspec.ValidationError):
        return anthropic_error(400, f"invalid request body: {e}")
    return anthropic_error(400, f"invalid request body: {undecodable_message(e)}")


def _reshaped(resp: web.Response) -> web.Response:
    """The app's OpenAI-shaped error (a 401, a 404, a 408, a 500...) in Anthropic's shape."""
    try:
        err = msgspec.json.decode(resp.body or b"")["error"]  # type: ignore[arg-type]
        message = err["message"] if isinstance(err, dict) else None
    except (*UNDECODABLE, KeyError, TypeError):
        return resp
    if not isinstance(message, str):
        return resp
    new = anthropic_error(resp.status, message)
    for name in ("Retry-After", "Connection"):
        if name in resp.headers:
            new.headers[name] = resp.headers[name]
    if resp.keep_alive is False:
        new.force_close()
    return new


@web.middleware
async def anthropic_errors(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Outermost: what the app answers on /v1/messages... in Anthropic's error shape."""
    resp = await handler(request)
    if (request.path == PATH or request.path.startswith(PATH + "/")) and resp.status >= 400 \
            and isinstance(resp, web.Response) and not resp.prepared:
        return _reshaped(resp)
    return resp


async def _read(request: web.Request, kind: type[Any], convert: Callable[[Any, Callable[[], str]], Any]) -> Any:
    """(request, what it becomes upstream), or the 408 to answer; raises what `_answer` reads."""
    body = await read_body(request)
    if isinstance(body, web.Response):
        return body
    new_id = request.app[GATEWAY].new_id

    def decode() -> tuple[Any, Any]:
        req = decode_body(body, kind)
        return req, convert(req, new_id)

    # Hundreds of milliseconds for a body with 100,000 messages: off the event loop, as on chat.
    return await asyncio.to_thread(decode) if len(body) > LARGE_BODY else decode()


async def handle_messages(request: web.Request) -> web.StreamResponse:
    app = request.app
    gateway, limits, budgets = app[GATEWAY], app[LIMITS], app[BUDGETS]
    who = request.remote or ""
    try:
        read = await _read(request, MessagesRequest, messages_generate)
        if isinstance(read, web.Response):
            return _reshaped(read)
        req, msg = read
        model = await _served_model(gateway, req.model)
        budgets.take(who, 1)
    except _INPUT_ERRORS as e:
        return _answer(e)
    try:
        fan = Fanout(gateway, [msg], limits.stream_buffer if req.stream else 0)
        fan.on_overflow = lambda held: _slow_reader(request, f"left {held} bytes unread, over --stream-buffer "
                                                             f"{limits.stream_buffer}", 1)
        builder = MessageBuilder(f"msg_{uuid.uuid4().hex}", model, req.stream)
        try:
            if req.stream:
                return await _stream(request, fan, builder)
            while batch := await fan.next_batch():
                for _, ev in batch:
                    if isinstance(ev, NoriaError):
                        return _answer(ev)
                    builder.add(ev)
            return json_response(builder.response())
        except ConnectionResetError:  # the client hung up between two writes
            return web.Response(status=499)
        finally:
            fan.close()  # whatever ended the handler, nothing runs on upstream for nobody
    finally:
        budgets.give(who, 1)


async def _stream(request: web.Request, fan: Fanout, builder: MessageBuilder) -> web.StreamResponse:
    # The headers wait for the first upstream event, so that a request the engine refuses gets
    # its status; later errors are an `error` event.
    batch = await fan.next_batch()
    for _, ev in batch:
        if isinstance(ev, NoriaError):
            return _answer(ev)
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    try:
        events = builder.start()
        while batch:
            for _, ev in batch:
                if isinstance(ev, NoriaError):
                    await _write(resp, events + [error_event(error_type(status_of(ev.code)), ev.message)])
                    return resp
                events += builder.add(ev)
            await _write(resp, events, more=True)
            events = []
            batch = await fan.next_batch()
        if fan.overflowed:
            return resp  # the connection is gone (_slow_reader)
        await _write(resp, builder.end())
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except TimeoutError:  # the client takes none of what waits for it
        _slow_reader(request, f"took nothing for {STREAM_STALL:g}s", 1)
    except Exception as e:  # a bug after the headers went out: the stream still ends, with an error event
        log.exception("internal error while streaming a message")
        await _write(resp, [error_event("api_error", f"internal error: {type(e).__name__}: {e}"[:500])])
    return resp


async def _write(resp: web.StreamResponse, events: list[bytes], *, more: bool = False) -> None:
    """One write per batch of events; a client that takes none of it for STREAM_STALL is gone."""
    if events:
        async with asyncio.timeout(STREAM_STALL):
            await resp.write(b"".join(events))
    if not more:
        await resp.write_eof()


async def handle_count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages renders it: one `tokenize`, answered by the frontend."""
    gateway = request.app[GATEWAY]
    try:
        read = await _read(request, CountTokensRequest, count_tokens_message)
        if isinstance(read, web.Response):
            return _reshaped(read)
        req, msg = read
        await _served_model(gateway, req.model)
        out = await gateway.client.ask(msg)
    except _INPUT_ERRORS as e:
        return _answer(e)
    if not isinstance(out, Tokenized):
        return anthropic_error(500, f"internal error: {type(out).__name__} answered a tokenize")
    return json_response(TokensCount(input_tokens=out.count))


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH, handle_messages)
    app.router.add_post(PATH + "/count_tokens", handle_count_tokens)

