"""OpenAI's Responses API: `POST /v1/responses` (whole, streamed, or `background`),
`GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A request becomes the chat completions request for the same conversation
(responses_requests, chat_translate) and runs upstream as chat does: the same body
deadline, per-client budget, stream buffer bound, metrics (the Gateway times it), and an
abort when the client hangs up. A background response is the one exception to that last
rule: it runs on, held to its client's budget, until it ends or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from noria.frontend.bridge.chat_translate import chat_generate_for
from noria.frontend.bridge.errors import BadRequest, error_response, from_decode, status_of
from noria.frontend.bridge.fanout import Fanout
from noria.frontend.bridge.limits import STREAM_STALL
from noria.frontend.bridge.openai_api import LARGE_BODY, json_response, read_body
from noria.frontend.bridge.openai_requests import decode_body
from noria.frontend.bridge.responses_events import ResponseBuilder, new_id
from noria.frontend.bridge.responses_requests import PARAMS, chat_fields, output_messages
from noria.frontend.bridge.responses_schema import DeletedResponse, Response, ResponsesRequest
from noria.frontend.bridge.responses_store import ResponseStore, Stored, owner_of
from noria.frontend.bridge.state import BUDGETS, GATEWAY, LIMITS, METRICS
from noria.protocol.client import Generate
from noria.protocol.errors import ErrorCode, NoriaError

log = logging.getLogger("noria.bridge")
STORE = web.AppKey("responses", ResponseStore)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_INPUT_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError)


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", handle_create)
    app.router.add_get("/v1/responses/{id}", handle_get)
    app.router.add_delete("/v1/responses/{id}", handle_delete)
    app.router.add_post("/v1/responses/{id}/cancel", handle_cancel)
    app.on_shutdown.append(_cancel_background)


async def _cancel_background(app: web.Application) -> None:
    for task in app[STORE].running():
        task.cancel()


def _param(p: str | None) -> str | None:
    return PARAMS.get(p, p) if p else p


def _refusal(e: Exception) -> web.Response:
    """The 4xx for a request that could not be read or served, naming Responses' fields."""
    if isinstance(e, BadRequest):
        return error_response(e.status, e.message, e.code, _param(e.param))
    if isinstance(e, NoriaError):
        return error_response(status_of(e.code), e.message, e.code, _param(e.param))
    return from_decode(e)


def _not_found(rid: str, param: str | None = None) -> web.Response:
    return error_response(404, f"Response with id '{rid}' not found.", "not_found", param)


def _prepare(body: bytes, store: ResponseStore, owner: str,
             new_request_id: Any) -> tuple[ResponsesRequest, Generate, list[dict[str, Any]]]:
    req = decode_body(body, ResponsesRequest)  # type: ignore[type-var]
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(owner, req.previous_response_id)
        if prev is None:
            raise BadRequest(f"Previous response with id '{req.previous_response_id}' not found.",
                             "previous_response_id", status=404, code="not_found")
        if prev.conversation is None:
            raise BadRequest(f"Previous response '{req.previous_response_id}' has not finished "
                             f"(status {prev.response.status}).", "previous_response_id")
        history = prev.conversation
    fields, conversation = chat_fields(req, history)
    return req, chat_generate_for(fields, new_request_id), conversation


def _template(req: ResponsesRequest, model: str) -> Response:
    return Response(
        id=new_id("resp"), created_at=int(time.time()), model=model, output=[], status="in_progress",
        tools=req.tools or [], tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        parallel_tool_calls=req.parallel_tool_calls is not False, instructions=req.instructions,
        metadata=req.metadata, temperature=req.temperature, top_p=req.top_p,
        max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
        background=req.background, store=req.store, text=req.text, reasoning=req.reasoning)


async def handle_create(request: web.Request) -> web.StreamResponse:
    app = request.app
    gateway, limits, budgets, store = app[GATEWAY], app[LIMITS], app[BUDGETS], app[STORE]
    owner = owner_of(request.headers.get("Authorization", ""))
    try:
        body = await read_body(request)
        if isinstance(body, web.Response):
            return body
        if len(body) > LARGE_BODY:  # off the event loop, as chat decodes its large bodies
            req, gen, conversation = await asyncio.to_thread(_prepare, body, store, owner, gateway.new_id)
        else:
            req, gen, conversation = _prepare(body, store, owner, gateway.new_id)
        ready = await gateway.ready()
        if req.model and req.model != ready.model:
            raise BadRequest(f"The model `{req.model}` does not exist; this server serves `{ready.model}`.",
                             "model", status=404, code="model_not_found")
        who = request.remote or ""
        budgets.take(who, 1)
    except _INPUT_ERRORS as e:
        return _refusal(e)
    builder = ResponseBuilder(_template(req, ready.model), req.stream)
    stored = Stored(response=builder.response) if req.store else None
    if stored is not None and req.background:
        builder.response.status = "queued"
        task = asyncio.get_running_loop().create_task(_background(app, builder, gen, stored, conversation))
        # A callback, not a `finally`: a task cancelled before its first step never runs its body.
        task.add_done_callback(lambda _: _ended(app, builder, stored, who))
        stored.task = task
        store.put(owner, stored)
        return json_response(builder.response)
    try:
        fan = Fanout(gateway, [gen], limits.stream_buffer if req.stream else 0)
        fan.on_overflow = lambda held: _slow_reader(request, f"left {held} bytes unread, over --stream-buffer "
                                                             f"{limits.stream_buffer}")
        try:
            answer = await (_stream(request, fan, builder) if req.stream else _whole(fan, builder))
        finally:
            fan.close()
    except ConnectionResetError:  # the client hung up between two writes
        return web.Response(status=499)
    finally:
        budgets.give(who, 1)
    if stored is not None and builder.response.status in ("completed", "incomplete"):
        stored.conversation = conversation + output_messages(builder.response.output)
        store.put(owner, stored)
    return answer


async def _whole(fan: Fanout, builder: ResponseBuilder) -> web.StreamResponse:
    while batch := await fan.next_batch():
        for _, ev in batch:
            if isinstance(ev, NoriaError):
                return _refusal(ev)
            builder.add(ev)
    return json_response(builder.response)


async def _stream(request: web.Request, fan: Fanout, builder: ResponseBuilder) -> web.StreamResponse:
    # Headers wait for the first upstream event, so that a request the engine refuses still
    # gets its HTTP status.
    batch = await fan.next_batch()
    for _, ev in batch:
        if isinstance(ev, NoriaError):
            return _refusal(ev)
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    chunks = builder.start()
    try:
        while batch:
            for _, ev in batch:
                if isinstance(ev, NoriaError):
                    await _write(resp, chunks + builder.fail(ev.code, ev.message, _param(ev.param)))
                    return resp
                chunks += builder.add(ev)
            await _write(resp, chunks)
            chunks = []
            batch = await fan.next_batch()
    except TimeoutError:  # _write: the client takes none of what waits for it
        _slow_reader(request, f"took nothing for {STREAM_STALL:g}s")
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # a bug after the headers went out: the stream still ends, failed
        log.exception("internal error while streaming a response")
        await _write(resp, builder.fail(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"[:500]))
    await resp.write_eof()
    return resp


async def _write(resp: web.StreamResponse, chunks: list[bytes]) -> None:
    if chunks:
        async with asyncio.timeout(STREAM_STALL):
            await resp.write(b"".join(chunks))


def _slow_reader(request: web.Request, why: str) -> None:
    request.app[METRICS].slow_readers.labels("sse").inc()
    log.warning("aborted a responses stream to %s: its client %s", request.remote, why)
    if request.transport is not None:
        request.transport.abort()


async def _background(app: web.Application, builder: ResponseBuilder, gen: Generate, stored: Stored,
                      conversation: list[dict[str, Any]]) -> None:
    fan = Fanout(app[GATEWAY], [gen])
    builder.response.status = "in_progress"
    try:
        while batch := await fan.next_batch():
            for _, ev in batch:
                if isinstance(ev, NoriaError):
                    builder.fail(ev.code, ev.message, _param(ev.param))
                    return
                builder.add(ev)
        stored.conversation = conversation + output_messages(builder.response.output)
    except Exception as e:
        log.exception("internal error in a background response")
        builder.fail(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"[:500])
    finally:
        fan.close()  # cancelled (/cancel, DELETE, eviction, shutdown): aborts it upstream


def _ended(app: web.Application, builder: ResponseBuilder, stored: Stored, who: str) -> None:
    app[BUDGETS].give(who, 1)
    stored.task = None
    if builder.response.status in ("queued", "in_progress"):
        builder.response.status = "cancelled"
    store = app[STORE]
    if store.get(stored.owner, builder.response.id) is stored:
        store.put(stored.owner, stored)  # its size has changed


async def handle_get(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    stored = request.app[STORE].get(owner_of(request.headers.get("Authorization", "")), rid)
    return _not_found(rid) if stored is None else json_response(stored.response)


async def handle_delete(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    stored = request.app[STORE].delete(owner_of(request.headers.get("Authorization", "")), rid)
    return _not_found(rid) if stored is None else json_response(DeletedResponse(id=rid))


async def handle_cancel(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    stored = request.app[STORE].get(owner_of(request.headers.get("Authorization", "")), rid)
    if stored is None:
        return _not_found(rid)
    if not stored.response.background:
        return error_response(400, "Cannot cancel a synchronous response.", ErrorCode.INVALID_REQUEST)
    task = stored.task
    if task is not None and not task.done():
        task.cancel()
        try:  # its upstream request is aborted and its status set before the answer goes
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this handler itself was cancelled
    if stored.response.status in ("queued", "in_progress"):  # its done callback has not run yet
        stored.response.status = "cancelled"
    return json_response(stored.response)

