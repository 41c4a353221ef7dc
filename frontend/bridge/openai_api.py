"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A streamed response waits for the first upstream event before it sends its
headers, so that a request the engine rejects still gets a proper HTTP status;
later errors arrive as an `error` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from noria.frontend.bridge.errors import (
    BadRequest,
    error_body,
    error_response,
    from_decode,
    from_noria,
    status_of,
)
from noria.frontend.bridge.fanout import Fanout
from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.limits import STREAM_STALL
from noria.frontend.bridge.openai_builders import ChatBuilder, CompletionBuilder
from noria.frontend.bridge.openai_requests import (
    R,
    chat_generate,
    completion_generates,
    decode_body,
    echo_prompts,
    prompts_of,
)
from noria.frontend.bridge.openai_schema import (
    ChatRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from noria.frontend.bridge.state import BUDGETS, GATEWAY, LIMITS, METRICS, STARTED, TOKEN_IDS
from noria.protocol.client import Generate
from noria.protocol.errors import ErrorCode, NoriaError

log = logging.getLogger("noria.bridge")
_encode = msgspec.json.Encoder().encode
LARGE_BODY = 64 << 10  # bytes: a body larger than this is decoded off the event loop
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


async def _served_model(gateway: Gateway, asked: str | None) -> str:
    ready = await gateway.ready()
    if asked and asked != ready.model:
        raise BadRequest(f"The model `{asked}` does not exist; this server serves `{ready.model}`.",
                         "model", status=404, code="model_not_found")
    return ready.model


async def handle_models(request: web.Request) -> web.Response:
    try:
        ready = await request.app[GATEWAY].ready()
    except NoriaError as e:
        return from_noria(e)
    card = ModelCard(id=ready.model, created=request.app[STARTED], max_model_len=ready.max_model_len, root=ready.model)
    return json_response(ModelList(data=[card]))


_INPUT_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError)


def _error_response(e: Exception) -> web.Response:
    """The OpenAI-shaped answer to a request that could not be read or served."""
    if isinstance(e, BadRequest):
        return e.response()
    if isinstance(e, NoriaError):
        return from_noria(e)
    return from_decode(e)  # type: ignore[arg-type]


async def handle_completions(request: web.Request) -> web.StreamResponse:
    def builder(req: CompletionRequest, model: str, num: int) -> CompletionBuilder:
        return CompletionBuilder(
            f"cmpl-{uuid.uuid4().hex}", model, int(time.time()), num, req.n,
            logprobs=req.logprobs is not None, stream=req.stream, include_usage=_include_usage(req),
            echo=echo_prompts(req, prompts_of(req.prompt)), echo_only=req.echo and req.max_tokens == 0,
            token_ids=_as_ids(request, req),
        )

    return await _serve(request, CompletionRequest, completion_generates, builder)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    def builder(req: ChatRequest, model: str, num: int) -> ChatBuilder:
        return ChatBuilder(
            f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time()), req.n,
            logprobs=req.logprobs, stream=req.stream, include_usage=_include_usage(req),
            token_ids=_as_ids(request, req),
        )

    return await _serve(request, ChatRequest, lambda req, new_id: [chat_generate(req, new_id)], builder)


def _as_ids(request: web.Request, req: SamplingFields) -> bool:
    """Logprob tokens as "token_id:ID": the request's choice, else the server's flag (vLLM's rule)."""
    own = req.return_tokens_as_token_ids
    return request.app[TOKEN_IDS] if own is None else own


async def read_body(request: web.Request) -> bytes | web.Response:
    """The body, read whole under a deadline (a client that sends its body slowly holds a
    connection and a buffer), or the 408 to answer when it did not come in time."""
    limits = request.app[LIMITS]
    try:
        async with asyncio.timeout(limits.body_timeout or None):
            return await request.read()
    except TimeoutError:
        request.app[METRICS].body_timeouts.inc()
        resp = error_response(408, f"the request body did not come within {limits.body_timeout:g}s "
                              "(--http-body-timeout)", "request_timeout")
        resp.force_close()  # the rest of the body is not worth waiting for
        return resp


async def _serve(request: web.Request, kind: type[R], to_messages: Callable[[R, Callable[[], str]], list[Generate]],
                 make_builder: Callable[[R, str, int], Any]) -> web.StreamResponse:
    """Read and check the body, then fan its generate messages out and build OpenAI's answer."""
    app = request.app
    gateway, limits, budgets = app[GATEWAY], app[LIMITS], app[BUDGETS]
    try:
        body = await read_body(request)
        if isinstance(body, web.Response):
            return body
        if len(body) > LARGE_BODY:
            # Hundreds of milliseconds of decoding and converting for a body with 100,000
            # messages: on a thread, so that the event loop keeps relaying everyone's streams.
            req, messages = await asyncio.to_thread(_decode, body, kind, to_messages, gateway.new_id)
        else:
            req, messages = _decode(body, kind, to_messages, gateway.new_id)
        model = await _served_model(gateway, req.model)
        who, cost = request.remote or "", sum(m.n for m in messages)
        budgets.take(who, cost)
    except _INPUT_ERRORS as e:
        return _error_response(e)
    try:
        fan = Fanout(gateway, messages, limits.stream_buffer if req.stream else 0)
        fan.on_overflow = lambda held: _slow_reader(request, f"left {held} bytes unread, over --stream-buffer "
                                                             f"{limits.stream_buffer}", cost)
        return await _run(request, fan, make_builder(req, model, len(messages)), cost)
    finally:
        budgets.give(who, cost)


def _decode(body: bytes, kind: type[R], to_messages: Callable[[R, Callable[[], str]], list[Generate]],
            new_id: Callable[[], str]) -> tuple[R, list[Generate]]:
    req = decode_body(body, kind)
    return req, to_messages(req, new_id)


def _slow_reader(request: web.Request, why: str, sequences: int) -> None:
    """A stream's client does not read (`why`): the connection is dropped, which ends the
    handler and with it the stream's requests upstream (if the Fanout has not already)."""
    request.app[METRICS].slow_readers.labels("sse").inc()
    log.warning("aborted a stream to %s: its client %s; %d sequence(s) aborted upstream", request.remote, why,
                sequences)
    if request.transport is not None:
        request.transport.abort()


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


async def _run(request: web.Request, fan: Fanout, builder: CompletionBuilder | ChatBuilder,
               sequences: int = 0) -> web.StreamResponse:
    # Whatever ends this handler (done, error, a client that hung up and got the
    # handler cancelled) aborts what is still running upstream.
    try:
        if builder.stream:
            try:
                return await _stream(request, fan, builder, sequences)
            except ConnectionResetError:  # the client hung up between two writes
                return web.Response(status=499)
        while batch := await fan.next_batch():
            for prompt, ev in batch:
                if isinstance(ev, NoriaError):
                    return from_noria(ev)
                builder.add(prompt, ev)
        return json_response(builder.response())
    finally:
        fan.close()


async def _stream(request: web.Request, fan: Fanout, builder: CompletionBuilder | ChatBuilder,
                  sequences: int) -> web.StreamResponse:
    batch = await fan.next_batch()
    for _, ev in batch:
        if isinstance(ev, NoriaError):
            return from_noria(ev)
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    try:
        await _events(resp, fan, builder, batch)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except TimeoutError:  # _write: the output waiting for the client stays there, the client takes none of it
        _slow_reader(request, f"took nothing for {STREAM_STALL:g}s", sequences)
    except Exception as e:  # a bug after the headers went out: the stream still ends, with an error event
        log.exception("internal error while streaming a response")
        await _write(resp, [error_body(500, f"internal error: {type(e).__name__}: {e}"[:500],
                                       ErrorCode.INTERNAL)], done=True)
    return resp


async def _events(resp: web.StreamResponse, fan: Fanout, builder: CompletionBuilder | ChatBuilder,
                  batch: list[Any]) -> None:
    chunks = builder.start()
    while batch:
        for prompt, ev in batch:
            if isinstance(ev, NoriaError):
                chunks.append(error_body(status_of(ev.code), ev.message, ev.code, ev.param))
                await _write(resp, chunks, done=True)
                return
            chunks.extend(builder.add(prompt, ev))
        await _write(resp, chunks)
        chunks = []
        batch = await fan.next_batch()
    chunks.extend(builder.end())
    await _write(resp, chunks, done=True)


async def _write(resp: web.StreamResponse, chunks: list[bytes], *, done: bool = False) -> None:
    """One write per batch of events: fewer syscalls when deltas come in bursts."""
    if done:
        chunks.append(b"[DONE]")
    if chunks:
        # resp.write waits while the transport holds more than its high-water mark; a client
        # that takes nothing that long is gone in all but name (it may still ACK with a closed window).
        async with asyncio.timeout(STREAM_STALL):
            await resp.write(b"".join(b"data: " + c + b"\n\n" for c in chunks))
    if done:
        await resp.write_eof()

