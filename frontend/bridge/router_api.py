"""What request routers ask an engine besides its metrics: load, server facts and rendered prompts.

- `GET /load` (vLLM's): `{"server_load": N}`, the requests open in the engine's frontend.
- `GET /get_load` (what vllm-router's and SGLang's power-of-two policies poll): `{"load": N, ...}`
  with N the engine's running plus waiting requests, and SGLang's per-rank fields beside it.
- `GET /get_server_info` and `/server_info` (SGLang's, read by routers for the engine's shape): the
  served model, its length, the cache's configuration and the engine's current state;
  `/get_model_info` and `/model_info`: the model's name, length and vocabulary.
- `POST /v1/completions/render` and `POST /v1/chat/completions/render` (vLLM's): the token ids a
  request's prompt(s) become, for routers that tokenize to pick an engine by its cached prefixes
  (llm-d's precise prefix-cache scorer). The body is read and checked as the generating endpoint
  reads it, and tokenized by the frontend's own path, so the ids are the ones the engine would run.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from noria.frontend.bridge.errors import BadRequest
from noria.frontend.bridge.openai_api import (
    _decode,
    _error_response,
    _served_model,
    json_response,
    read_body,
)
from noria.frontend.bridge.openai_requests import chat_generate, completion_generates
from noria.frontend.bridge.openai_schema import ChatRequest, CompletionRequest
from noria.frontend.bridge.state import GATEWAY
from noria.protocol.client import Generate, SchedulerStats, Stats, Tokenize, Tokenized
from noria.protocol.errors import NoriaError

_INPUT_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/load", handle_load)
    app.router.add_get("/get_load", handle_get_load)
    # SGLang's routers ask /server_info and /model_info first, then the older /get_* names.
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, handle_server_info)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, handle_model_info)
    app.router.add_post("/v1/completions/render", handle_completions_render)
    app.router.add_post("/v1/chat/completions/render", handle_chat_render)


async def _stats(request: web.Request) -> Stats | web.Response:
    try:
        return await request.app[GATEWAY].stats()
    except (NoriaError, TimeoutError):
        return web.json_response({"error": "the engine did not answer"}, status=503)


async def handle_load(request: web.Request) -> web.Response:
    stats = await _stats(request)
    if isinstance(stats, web.Response):
        return stats
    return web.json_response({"server_load": stats.num_open_requests})


def _used_tokens(s: SchedulerStats) -> int:
    return (s.num_kv_blocks - s.num_free_blocks) * s.block_size


async def handle_get_load(request: web.Request) -> web.Response:
    stats = await _stats(request)
    if isinstance(stats, web.Response):
        return stats
    s = stats.stats
    return web.json_response({"load": s.num_running + s.num_waiting, "dp_rank": 0,
                              "num_reqs": s.num_running + s.num_waiting, "num_running_reqs": s.num_running,
                              "num_waiting_reqs": s.num_waiting, "num_tokens": _used_tokens(s)})


async def handle_server_info(request: web.Request) -> web.Response:
    stats = await _stats(request)
    if isinstance(stats, web.Response):
        return stats
    try:
        ready = await request.app[GATEWAY].ready()
    except NoriaError as e:
        return _error_response(e)
    s = stats.stats
    return web.json_response({
        "model_path": ready.model, "served_model_name": ready.model, "max_model_len": ready.max_model_len,
        "vocab_size": ready.vocab_size, "block_size": s.block_size, "kv_cache_dtype": s.kv_cache_dtype or "auto",
        "num_gpu_blocks": s.num_kv_blocks, "num_cpu_blocks": s.num_cpu_blocks,
        "enable_prefix_caching": s.enable_prefix_caching, "dp_size": max(1, len(stats.engines)),
        "dp_rank": stats.data_parallel_rank, "status": stats.status,
        "internal_states": [{**msgspec.to_builtins(s), "num_open_requests": stats.num_open_requests}],
    })


async def handle_model_info(request: web.Request) -> web.Response:
    try:
        ready = await request.app[GATEWAY].ready()
    except NoriaError as e:
        return _error_response(e)
    return web.json_response({"model_path": ready.model, "tokenizer_path": ready.model,
                              "max_model_len": ready.max_model_len, "vocab_size": ready.vocab_size})


async def _token_ids(request: web.Request, msg: Generate) -> list[int]:
    """The prompt of `msg` as the frontend tokenizes it for generation (Processor.tokenize)."""
    if msg.prompt_token_ids is not None:
        return list(msg.prompt_token_ids)
    gateway = request.app[GATEWAY]
    ask = Tokenize(request_id=gateway.new_id(), prompt=msg.prompt, messages=msg.messages,
                   add_special_tokens=None if msg.prompt is not None else False,
                   add_generation_prompt=msg.add_generation_prompt,
                   continue_final_message=msg.continue_final_message, chat_template=msg.chat_template,
                   chat_template_kwargs=msg.chat_template_kwargs, tools=msg.tools)
    out = await gateway.client.ask(ask)
    assert isinstance(out, Tokenized)
    return out.tokens


async def _render(request: web.Request, kind: type[Any], to_messages: Any, prefix: str) -> list[dict[str, Any]] | web.Response:
    gateway = request.app[GATEWAY]
    body = await read_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        req, messages = _decode(body, kind, to_messages, gateway.new_id)
        model = await _served_model(gateway, req.model)
        rendered = []
        for msg in messages:
            rendered.append({"request_id": f"{prefix}-{msg.request_id}", "token_ids": await _token_ids(request, msg),
                             "sampling_params": msgspec.to_builtins(msg.own_sampling()), "model": model, "stream": bool(req.stream),
                             "cache_salt": msg.cache_salt, "priority": msg.priority})
    except _INPUT_ERRORS as e:  # what the generating endpoint would answer
        return _error_response(e)
    return rendered


async def handle_completions_render(request: web.Request) -> web.Response:
    """A list: one rendered request per prompt (a completion may carry several)."""
    out = await _render(request, CompletionRequest, completion_generates, "cmpl")
    return out if isinstance(out, web.Response) else json_response(out)


async def handle_chat_render(request: web.Request) -> web.Response:
    """One rendered request: the messages through the chat template, as token ids."""
    out = await _render(request, ChatRequest, lambda req, new_id: [chat_generate(req, new_id)], "chatcmpl")
    return out if isinstance(out, web.Response) else json_response(out[0])
