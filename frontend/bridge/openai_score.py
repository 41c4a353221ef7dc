"""Scores from an engine whose model classifies (`--runner pooling` over a sequence-classification
checkpoint, or a reranker configured by `--hf-overrides`: protocol/score.py), in vLLM's shapes:

* POST /v1/score: `text_1` against `text_2` (a string or a list each: one against many, or
  pairwise) -> `data[i].score`.
* POST /v1/rerank, /rerank, /v2/rerank: `query` against `documents` (strings, or Cohere's and
  Jina's `{"text": ...}`), ordered by relevance, `top_n` of them, with the document unless
  `return_documents` is false -> Cohere's and Jina's `results[].index / relevance_score / document`.
* POST /classify: `input` (a string or strings) -> each input's label probabilities.

Each pair or input is one `embed` upstream with task "classify" (a pair is one sequence, the
tokenizer's pair encoding), run side by side as /v1/embeddings runs its inputs, under the same
per-client budget; a score is the one label's probability (sigmoid of its logit, vLLM's).
"""

from __future__ import annotations

import asyncio
import time
import uuid
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
from noria.frontend.bridge.openai_embeddings import MAX_INPUTS, run_embeds
from noria.frontend.bridge.openai_requests import decode_body
from noria.frontend.bridge.state import BUDGETS, GATEWAY
from noria.protocol.client import Embed, Embedding
from noria.protocol.errors import NoriaError
from noria.protocol.sampling import Int64


class _Extras(msgspec.Struct, kw_only=True):
    model: str | None = None
    user: str | None = None  # cannot change the output: ignored
    priority: Int64 = 0
    cache_salt: str | None = None


class ScoreRequest(_Extras, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Extras, kw_only=True):
    query: str
    documents: list[str | dict[str, Any]]
    top_n: Int64 | None = None  # None or 0: every document
    return_documents: bool = True


class ClassifyRequest(_Extras, kw_only=True):
    input: str | list[str]


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage
    object: str = "list"


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyData(msgspec.Struct, kw_only=True):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage
    object: str = "list"


def _texts(value: str | list[str], field: str) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise BadRequest(f"{field} must be a string or a non-empty list of strings", field)
    return items


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or the two lists index by index."""
    first, second = _texts(text_1, "text_1"), _texts(text_2, "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise BadRequest(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2", "text_2")
    return list(zip(first, second, strict=True))


def _document_text(doc: str | dict[str, Any]) -> str:
    if isinstance(doc, str):
        return doc
    text = doc.get("text")
    if not isinstance(text, str):
        raise BadRequest("each document must be a string or an object with a string \"text\"", "documents")
    return text


async def _classify(request: web.Request, kind: type[Any], pairs_of: Any,
                    param_of: dict[str, str]) -> tuple[Any, str, list[Embedding]] | web.Response:
    """Decode the body as `kind`, make its (text, pair-or-None) inputs with `pairs_of(req)` and
    classify them all: the request, the model's name and the answers in input order."""
    app = request.app
    gateway, budgets = app[GATEWAY], app[BUDGETS]
    try:
        body = await read_body(request)
        if isinstance(body, web.Response):
            return body
        req = await asyncio.to_thread(decode_body, body, kind) if len(body) > LARGE_BODY else decode_body(body, kind)
        inputs: list[tuple[str, str | None]] = pairs_of(req)
        if len(inputs) > MAX_INPUTS:
            raise BadRequest(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param_of["prompt"])
        model = await _served_model(gateway, req.model)
        who, cost = request.remote or "", len(inputs)
        try:
            budgets.take(who, cost)
        except BadRequest as e:
            e.param = param_of["prompt"] if e.param == "n" else e.param  # one sequence per input
            raise
    except (msgspec.DecodeError, msgspec.ValidationError, BadRequest, NoriaError) as e:
        return _error_response(e)
    try:
        msgs = [Embed(request_id=gateway.new_id(), prompt=text, text_pair=pair, task="classify",
                      priority=req.priority, cache_salt=req.cache_salt) for text, pair in inputs]
        outs = await run_embeds(gateway, msgs, param_of)
    finally:
        budgets.give(who, cost)
    return outs if isinstance(outs, web.Response) else (req, model, outs)


def _one_label(outs: list[Embedding]) -> list[float] | web.Response:
    """Each answer's score: a cross-encoder's one label (a model of several is /classify's)."""
    if outs and len(outs[0].embedding) != 1:
        return _error_response(BadRequest(f"this model classifies into {len(outs[0].embedding)} labels; scores and "
                                          "reranking need a one-label cross-encoder (use /classify)"))
    return [o.embedding[0] for o in outs]


def _tokens(outs: list[Embedding]) -> int:
    return sum(o.usage.prompt_tokens for o in outs)


async def handle_score(request: web.Request) -> web.Response:
    got = await _classify(request, ScoreRequest, lambda r: score_pairs(r.text_1, r.text_2),
                          {"prompt": "text_1", "text_pair": "text_2"})
    if isinstance(got, web.Response):
        return got
    _, model, outs = got
    scores = _one_label(outs)
    if isinstance(scores, web.Response):
        return scores
    tokens = _tokens(outs)
    return json_response(ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                       data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                       usage=Usage(prompt_tokens=tokens, total_tokens=tokens)))


def _rerank_inputs(req: RerankRequest) -> list[tuple[str, str | None]]:
    if not req.documents:
        raise BadRequest("documents must hold at least one document", "documents")
    if req.top_n is not None and req.top_n < 0:
        raise BadRequest(f"top_n must be at least 0, got {req.top_n}", "top_n")
    return [(req.query, _document_text(d)) for d in req.documents]


async def handle_rerank(request: web.Request) -> web.Response:
    got = await _classify(request, RerankRequest, _rerank_inputs, {"prompt": "documents", "text_pair": "documents"})
    if isinstance(got, web.Response):
        return got
    req, model, outs = got
    scores = _one_label(outs)
    if isinstance(scores, web.Response):
        return scores
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep document order
    if req.top_n:
        order = order[: req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=_document_text(req.documents[i]))
                            if req.return_documents else None) for i in order]
    return json_response(RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model,
                                        usage=RerankUsage(total_tokens=_tokens(outs)), results=results))


async def handle_classify(request: web.Request) -> web.Response:
    got = await _classify(request, ClassifyRequest, lambda r: [(t, None) for t in _texts(r.input, "input")],
                          {"prompt": "input", "prompt_token_ids": "input"})
    if isinstance(got, web.Response):
        return got
    _, model, outs = got
    data = []
    for i, o in enumerate(outs):
        labels = o.labels if isinstance(o.labels, list) else [f"LABEL_{j}" for j in range(len(o.embedding))]
        best = max(range(len(o.embedding)), key=lambda j: o.embedding[j])
        data.append(ClassifyData(index=i, label=labels[best], probs=o.embedding, num_classes=len(o.embedding)))
    tokens = _tokens(outs)
    return json_response(ClassifyResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                          data=data, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)))
