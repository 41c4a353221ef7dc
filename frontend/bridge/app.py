"""The bridge's aiohttp application: routes, API-key check, OpenAI-shaped errors."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import WSCloseCode, web

from noria.frontend.bridge.anthropic_api import add_routes as add_anthropic_routes
from noria.frontend.bridge.anthropic_api import anthropic_errors
from noria.frontend.bridge.errors import error_response, internal_error
from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.limits import BridgeLimits, ClientBudgets
from noria.frontend.bridge.metrics import CONTENT_TYPE, BridgeMetrics
from noria.frontend.bridge.openai_api import (
    handle_chat,
    handle_completions,
    handle_models,
    json_response,
)
from noria.frontend.bridge.openai_embeddings import handle_embeddings
from noria.frontend.bridge.openai_schema import Health
from noria.frontend.bridge.openai_score import handle_classify, handle_rerank, handle_score
from noria.frontend.bridge.openai_tokenize import handle_detokenize, handle_tokenize
from noria.frontend.bridge.playground import handle_playground
from noria.frontend.bridge.responses_api import add_routes as add_responses_routes
from noria.frontend.bridge.router_api import add_routes as add_router_routes
from noria.frontend.bridge.state import (
    API_KEY,
    BUDGETS,
    GATEWAY,
    LIMITS,
    METRICS,
    STARTED,
    TOKEN_IDS,
    WEBSOCKETS,
)
from noria.frontend.bridge.websocket import handle_stream
from noria.frontend.client import AsyncClient
from noria.protocol.errors import NoriaError

log = logging.getLogger("noria.bridge")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(engine: str, api_key: str | None = None, max_per_client: int | None = None,
             curve_keys: str | None = None, limits: BridgeLimits | None = None,
             return_tokens_as_token_ids: bool = False) -> web.Application:
    """`max_per_client`: sequences in flight per client address (None: no cap); `limits`, the
    bridge's other caps (its defaults when None); `return_tokens_as_token_ids`: logprob
    tokens spelled "token_id:ID" by default (vLLM's flag)."""
    # anthropic_errors outermost: /v1/messages answers every error in Anthropic's shape.
    app = web.Application(middlewares=[anthropic_errors, _errors, _auth], client_max_size=64 * 2**20)
    app[API_KEY] = api_key or ""
    limits = limits or BridgeLimits()
    if max_per_client is not None:
        limits = dataclasses.replace(limits, per_client=max_per_client)
    app[LIMITS] = limits
    app[BUDGETS] = ClientBudgets(limits.per_client)
    app[METRICS] = BridgeMetrics()
    app[WEBSOCKETS] = weakref.WeakSet()
    app[STARTED] = int(time.time())
    app[TOKEN_IDS] = return_tokens_as_token_ids

    async def upstream(app: web.Application) -> AsyncIterator[None]:
        # No per-message timeout: a request may wait long in a busy engine; the
        # heartbeat is what tells a dead engine from a slow one.
        # A relay: the engine's per-connection cap would count all the bridge's clients as
        # one; the bridge caps each of them itself (BUDGETS).
        client = AsyncClient(engine, timeout=None, curve_keys=curve_keys, relay=True)
        app[GATEWAY] = Gateway(client, app[METRICS])
        await client.connect()
        yield
        client.close()

    app.cleanup_ctx.append(upstream)
    app.on_shutdown.append(_close_websockets)
    app.router.add_get("/", handle_playground)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/embeddings", handle_embeddings)
    app.router.add_post("/v1/score", handle_score)
    app.router.add_post("/classify", handle_classify)  # vLLM's path, beside /v1
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # vLLM's three (Jina's, Cohere's v1 and v2)
        app.router.add_post(path, handle_rerank)
    add_anthropic_routes(app)
    add_responses_routes(app)  # /v1/responses and /v1/responses/{id}[/cancel]
    add_router_routes(app)  # /load, /get_load, /get_server_info, /v1/[chat/]completions/render
    app.router.add_get("/v1/stream", handle_stream)
    # vLLM serves these two beside /v1, not under it.
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/detokenize", handle_detokenize)
    return app


async def handle_health(request: web.Request) -> web.Response:
    """200 while the engine answers and a worker group serves it; 503 with the reason otherwise
    ("draining" once the server got SIGTERM)."""
    gateway = request.app[GATEWAY]
    address = gateway.client.address
    try:
        ready = await gateway.ready()
        stats = await gateway.stats()
    except NoriaError as e:
        return json_response(Health(status="unavailable", engine=address, reason=f"{e.code}: {e.message}"), status=503)
    except TimeoutError:
        return json_response(Health(status="unavailable", engine=address, reason="no stats from the engine"), status=503)
    if stats.status != "ok":  # "draining" (SIGTERM) or "restarting" (a new scheduler is starting)
        return json_response(Health(status="unavailable", engine=address, model=ready.model, reason=stats.reason),
                             status=503)
    if not stats.stats.workers_live:
        reason = f"no worker: {stats.stats.worker_status}"
        return json_response(Health(status="unavailable", engine=address, model=ready.model, reason=reason), status=503)
    st = stats.stats
    return json_response(Health(status="ok", engine=address, model=ready.model,
                                attention_backend=st.attention_backend or None,
                                attention_reason=st.attention_reason or None))


async def handle_metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    try:
        stats = await request.app[GATEWAY].stats()
    except (NoriaError, TimeoutError):
        stats = None
    try:
        model: str | None = (await request.app[GATEWAY].ready()).model
    except NoriaError:
        model = None  # the series keep the last name they had
    metrics.update(stats, model)
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})


_GUARDED_OUTSIDE_V1 = frozenset({"/tokenize", "/detokenize", "/rerank", "/v2/rerank", "/classify"})


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`--api-key` guards the API (/v1/..., /tokenize, /detokenize, /rerank, /v2/rerank, /classify);
    health, metrics and the
    page itself stay open.

    Browsers cannot set headers on a websocket, so /v1/stream also takes `?api_key=`.
    """
    key = request.app[API_KEY]
    if key and (request.path.startswith("/v1/") or request.path in _GUARDED_OUTSIDE_V1):
        given = request.headers.get("Authorization", "")
        given = given[7:] if given.startswith("Bearer ") else ""
        if not given:  # Anthropic's clients send the key so
            given = request.headers.get("x-api-key", "")
        if not given and request.path == "/v1/stream":
            given = request.query.get("api_key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            why = "missing" if not given else "incorrect"
            return error_response(401, f"{why} API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
                                  "invalid_api_key")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413) in OpenAI's shape too, and a bug's: a 500 with
    a JSON body (its traceback logged once, here), never aiohttp's text page."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason if e.status != 404 else f"no route for {request.method} {request.path}")
    except ConnectionError:
        raise  # the client has gone: nobody to answer
    except Exception as e:
        log.exception("internal error on %s %s", request.method, request.path)
        return internal_error(e)


async def _close_websockets(app: web.Application) -> None:
    for ws in list(app[WEBSOCKETS]):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
