"""Request bookkeeping shared by the ZMQ server and the offline LLM.

Maps client requests (a key plus n samples) to engine requests, one per
sample (this class alone knows which engine ids are one request's), hands
engine updates to their samples (frontend/sample_output.py: detokenizer, stop
strings, deltas), applies the admission caps, and makes sure every request
ends with exactly one final message (done or error).

What the engine needs of a request is made once for all its samples
(frontend/prepare.py) and crosses to the scheduler in one `EngineRequest`;
stop strings and other text stay in the frontend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import msgspec

from noria.frontend.chat_output import ChatConfig
from noria.frontend.embeddings import Embedder
from noria.frontend.engine_client import EngineClient
from noria.frontend.prepare import Prepared, prepare
from noria.frontend.processor import InputProcessor
from noria.frontend.sample_output import Sample, done_message
from noria.protocol.client import (
    Delta,
    Done,
    Embed,
    Embedding,
    Error,
    Generate,
    SchedulerStats,
    Usage,
)
from noria.protocol.engine import EngineOutputs, EngineRequest, EngineSample
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.kv_transfer import KVTransferParams, as_json, read_params
from noria.protocol.sampling import EngineSamplingParams

Sink = Callable[[Delta | Done | Error | Embedding], None]
# How the scheduler begins a grammar's compile error (scheduler/scheduler.py).
_GRAMMAR = "structured_output does not compile: "


class _Request:
    __slots__ = ("key", "client", "started", "request_id", "sink", "prompt_ids", "samples", "open",
                 "num_cached_tokens", "params", "priority", "group", "resumed", "cache_salt", "embed",
                 "grammar_param", "kv_params", "kv_answer")

    def __init__(self, key: Hashable, client: Hashable, request_id: str, sink: Sink, prompt_ids: list[int],
                 params: EngineSamplingParams, priority: int, group: int | None,
                 cache_salt: str | None = None) -> None:
        self.key = key
        self.client = client
        self.started = False  # the engine has sent something for it: it left the waiting queue
        self.request_id = request_id
        self.sink = sink
        self.prompt_ids = prompt_ids
        self.samples: list[Sample] = []
        self.open = 0
        self.num_cached_tokens = 0
        # What its engine requests are made of, to send them again to a restarted scheduler.
        self.params = params
        self.priority = priority
        self.group = group
        self.cache_salt = cache_salt
        self.resumed = False
        self.embed: Embed | None = None
        # The field to blame when its grammar does not compile: `tools` where the grammar is
        # tool_choice's, made from the tools' parameters (the client sent no grammar itself).
        self.grammar_param: str | None = None
        # Prefill/decode disaggregation: what the request asked (sent again on a resubmission),
        # and a producer's answer for the client.
        self.kv_params: KVTransferParams | None = None
        self.kv_answer: dict[str, Any] | None = None


class Limits(msgspec.Struct, frozen=True):
    """Admission caps (None: no cap). `max_queued`: client requests the engine has not
    started yet (no output so far); `max_per_client`: open requests per connection."""

    max_queued: int | None = None
    max_per_client: int | None = None


class FrontendCore:
    def __init__(self, engine: EngineClient, processor: InputProcessor, limits: Limits | None = None,
                 embedder: Embedder | None = None, chat: ChatConfig | None = None) -> None:
        """`embedder`: the engine pools (--runner pooling) and takes `embed` requests only."""
        self.engine = engine
        self.processor = processor
        self.embedder = embedder
        self.chat = chat or ChatConfig()  # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
        self.limits = limits or Limits()
        self.num_queued = 0
        self.per_client: Counter[Hashable] = Counter()
        # Connections that said they relay many clients (the bridge) and cap each one
        # themselves: `max_per_client` does not apply to them, `max_queued` does.
        self.relays: dict[Hashable, None] = {}  # in the order they last said so
        self._next_id = 0
        self.by_rid: dict[int, tuple[_Request, Sample]] = {}
        self.by_key: dict[Hashable, _Request] = {}
        self.stats: SchedulerStats | None = None
        self.dead_reason: str | None = None
        # (code, message) that new requests get while the server is not taking any (draining,
        # or its restarting engine has been gone past --worker-wait); None: they are taken.
        self.refusing: tuple[str, str] | None = None
        self.data_parallel_rank = 0  # --data-parallel-rank, for the stats (routers label by it)

    @property
    def num_open(self) -> int:
        return len(self.by_key)

    def prepare(self, msg: Generate | Embed) -> Prepared:
        """Validate, template and tokenize `msg`; raises NoriaError naming the problem.
        Reads the processor only, so it may run on another thread than the rest."""
        return prepare(msg, self.processor, self.embedder, self.chat)

    def submit(self, key: Hashable, msg: Generate | Embed, sink: Sink, stream: bool = True, client: Hashable = None,
               prepared: Prepared | NoriaError | None = None) -> None:
        """Start a request; `sink` gets its messages. With `stream=False` the
        sink gets one delta per sample when it finishes (cheaper: offline use).
        `client` names the connection, for the per-connection cap. `prepared`: what
        `prepare(msg)` returned or raised, if it already ran."""
        refusal = self._refusal(key, msg.request_id, client)
        if refusal is not None:
            sink(Error(request_id=msg.request_id, code=refusal[0], message=refusal[1]))
            return
        if prepared is None:
            try:
                prepared = self.prepare(msg)
            except NoriaError as e:
                prepared = e
        if isinstance(prepared, NoriaError):
            sink(Error(request_id=msg.request_id, code=prepared.code, message=prepared.message,
                       param=prepared.param))
            return
        params, prompt_ids = prepared.params, prepared.prompt_ids
        first = self._next_id
        self._next_id += params.n
        group = first if params.n > 1 else None  # any id unique to this request
        req = _Request(key, client, msg.request_id, sink, prompt_ids, prepared.engine_params, msg.priority, group,
                       msg.cache_salt)
        req.embed = prepared.embed
        req.kv_params = read_params(getattr(msg, "kv_transfer_params", None))  # checked by `prepare`
        if prepared.chat is not None and prepared.chat.structured is not None:
            req.grammar_param = "tools"
        tok, eos = self.processor.tokenizer, self.processor.eos_ids
        for i in range(params.n):
            sample = Sample.start(first + i, i, prepared, tok, eos, stream)
            req.samples.append(sample)
            self.by_rid[sample.rid] = (req, sample)
        self.engine.add(EngineRequest(first, prompt_ids, prepared.engine_params, self.processor.eos_ids,
                                      msg.priority, group,
                                      more_samples=[EngineSample(first + i, i) for i in range(1, params.n)],
                                      cache_salt=msg.cache_salt, kv_transfer_params=req.kv_params))
        req.open = params.n
        self.by_key[key] = req
        self.num_queued += 1
        self.per_client[client] += 1

    def _refusal(self, key: Hashable, request_id: str, client: Hashable) -> tuple[str, str] | None:
        if self.dead_reason:
            return ErrorCode.ENGINE_DEAD, self.dead_reason
        if self.refusing:
            return self.refusing
        if key in self.by_key:
            return ErrorCode.DUPLICATE_REQUEST, f"request_id {request_id!r} is already in flight"
        cap = self.limits.max_queued
        if cap is not None and self.num_queued >= cap:
            return ErrorCode.OVERLOADED, f"the server is overloaded, engine queue full: {self.num_queued} requests wait to start; retry later"
        cap = self.limits.max_per_client
        if cap is not None and self.per_client[client] >= cap and client not in self.relays:
            return ErrorCode.OVERLOADED, f"per-connection limit: this connection already has {cap} requests in flight; retry later"
        return None

    def abort(self, key: Hashable) -> None:
        """Client-side abort: the request ends now with finish_reason "abort"."""
        req = self.by_key.get(key)
        if req is None:
            return
        open_rids = [s.rid for s in req.samples if s.finish_reason is None]
        for s in req.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        self._close(req)
        self.engine.abort(open_rids)
        req.sink(self._done(req))

    def abort_where(self, pred: Callable[[Hashable], bool]) -> int:
        keys = [k for k in self.by_key if pred(k)]
        for k in keys:
            self.abort(k)
        return len(keys)

    def on_outputs(self, out: EngineOutputs) -> None:
        if out.stats is not None:
            self.stats = out.stats
        for u in out.updates:
            entry = self.by_rid.get(u.req_id)
            if entry is None:
                continue  # already finished here (stop string, client abort)
            req, s = entry
            if not req.started:
                req.started = True
                self.num_queued -= 1
            if u.finish_reason == "error":
                # Errors concern the whole request (all samples).
                code, message, param = u.error_code or ErrorCode.INTERNAL, u.error_message or "engine error", None
                if code == ErrorCode.INVALID_GRAMMAR and req.grammar_param is not None:
                    param = req.grammar_param
                    message = f"a tool's parameters do not compile as a JSON schema: {message.removeprefix(_GRAMMAR)}"
                self._fail(req, code, message, param)
                continue
            if u.embedding is not None:
                self._embedded(req, s, u.embedding, u.num_cached_tokens)
                continue
            if u.kv_transfer_params is not None:
                req.kv_answer = as_json(u.kv_transfer_params)
            if s.index == 0 and not req.resumed:
                # The prompt counts once, as sample 0 found it: the other samples'
                # hits on sample 0's blocks are no cached tokens for the client.
                req.num_cached_tokens = u.num_cached_tokens
            delta, finish, cut = s.on_update(u, req.request_id, req.prompt_ids, self.processor.token_texts)
            if cut:  # a stop string ended it: the engine need not go on
                self.engine.abort([s.rid])
            if delta is not None:
                req.sink(delta)
            if finish is not None:
                self._finish_sample(req, s, finish)

    def _embedded(self, req: _Request, s: Sample, pooled: bytes, num_cached_tokens: int) -> None:
        """An `embed` request's one result: its final message."""
        assert req.embed is not None and self.embedder is not None, "an embedding for a request that asked none"
        vector = self.embedder.vector(pooled, req.embed.dimensions)
        s.finish_reason = "stop"
        self._close(req)
        req.sink(Embedding(request_id=req.request_id, embedding=vector,
                           usage=Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=0,
                                       cached_tokens=num_cached_tokens), labels=self.embedder.labels))

    def _finish_sample(self, req: _Request, s: Sample, finish: str) -> None:
        s.finish(finish)
        del self.by_rid[s.rid]
        req.open -= 1
        if req.open == 0:
            self._forget(req)
            req.sink(self._done(req))

    def fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        self.end_all(ErrorCode.ENGINE_DEAD, reason)

    def end_all(self, code: str, message: str) -> int:
        """End every open request with one error (`code`); how many ended."""
        reqs = list(self.by_key.values())
        for req in reqs:
            self._fail(req, code, message)
        return len(reqs)

    def resubmit_all(self) -> int:
        """Send every open sample to a restarted scheduler, which has none of them: the same
        engine id, index, prompt and parameters, with the outputs the client already has as
        `output_token_ids`, so the sample goes on where it stopped (a sample that has output
        tokens has had its prompt logprobs). One engine request per client request.
        Returns how many samples."""
        return self.resubmit(None)

    def resubmit(self, rids: set[int] | None) -> int:
        """`resubmit_all` for the open samples among `rids` only (None: all of them): those of an
        engine that died while others serve (frontend/engine_group.py). Returns how many."""
        eos = self.processor.eos_ids
        sent = 0
        for req in list(self.by_key.values()):
            open_samples = [s for s in req.samples if s.rid in self.by_rid and (rids is None or s.rid in rids)]
            if not open_samples:
                continue
            sent += len(open_samples)
            req.resumed = req.resumed or any(s.ids for s in open_samples)
            first, *rest = open_samples
            self.engine.add(EngineRequest(first.rid, req.prompt_ids, req.params, eos, req.priority, req.group,
                                          output_token_ids=first.ids, sample_index=first.index,
                                          more_samples=[EngineSample(s.rid, s.index, s.ids) for s in rest],
                                          cache_salt=req.cache_salt, kv_transfer_params=req.kv_params))
        return sent

    def _fail(self, req: _Request, code: str, message: str, param: str | None = None) -> None:
        open_rids = [s.rid for s in req.samples if s.finish_reason is None]
        for s in req.samples:
            s.finish_reason = s.finish_reason or "error"
        self._close(req)
        if not self.dead_reason:
            self.engine.abort(open_rids)
        req.sink(Error(request_id=req.request_id, code=code, message=message, param=param))

    def _close(self, req: _Request) -> None:
        for s in req.samples:
            self.by_rid.pop(s.rid, None)
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        if self.by_key.pop(req.key, None) is None:
            return
        if not req.started:
            self.num_queued -= 1
        left = self.per_client[req.client] - 1
        if left:
            self.per_client[req.client] = left
        else:
            del self.per_client[req.client]

    @staticmethod
    def _done(req: _Request) -> Done:
        done = done_message(req.request_id, req.prompt_ids, req.samples, req.num_cached_tokens)
        if req.kv_answer is not None:
            done.kv_transfer_params = req.kv_answer
        return done
