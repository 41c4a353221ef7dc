"""The ZeroMQ client library: `AsyncClient` (asyncio) and `Client` (blocking).

One DEALER socket carries many requests; a reader task routes each reply to
its request's queue by request_id. `Client` runs an `AsyncClient` on a private
event loop thread, so both share one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from frontend.outputs import CompletionOutput, RequestOutput
from protocol.client import (
    Abort,
    Delta,
    Done,
    Error,
    Generate,
    GetStats,
    Hello,
    Logprob,
    Ready,
    ServerToClient,
    Stats,
)
from protocol.codec import Codec
from protocol.errors import ErrorCode, NoriaError
from protocol.sampling import SamplingParams

T = TypeVar("T")
_HELLO = "\x00hello"
_NO_ID = "\x00errors"
_STATS = "\x00stats"


class AsyncClient:
    def __init__(self, address: str = "tcp://127.0.0.1:5555", *, timeout: float | None = 60.0) -> None:
        """`timeout`: seconds to wait for each message from the server before
        raising NoriaError("timeout") — an engine that is gone never hangs a caller."""
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._codec: Codec[ServerToClient] = Codec(ServerToClient)
        self._queues: dict[str, asyncio.Queue[Delta | Done | Error | Ready]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid():x}{id(self) & 0xFFFF:x}-"

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                msg = self._codec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(msg, Ready):
                key = _HELLO
            elif isinstance(msg, Stats):
                key = _STATS
            else:
                key = msg.request_id or _NO_ID
            q = self._queues.get(key)
            if q is not None:
                q.put_nowait(msg)

    async def _next(self, q: asyncio.Queue[Any], what: str) -> Any:
        try:
            return await asyncio.wait_for(q.get(), self.timeout)
        except TimeoutError:
            raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for {what} within {self.timeout}s") from None

    async def hello(self) -> Ready:
        self._ensure_reader()
        q = self._queues.setdefault(_HELLO, asyncio.Queue())
        await self._sock.send(self._codec.encode(Hello()))
        return await self._next(q, "hello")

    async def stats(self) -> Stats:
        """The engine's latest stats (running/waiting requests, KV usage, counters)."""
        self._ensure_reader()
        q = self._queues.setdefault(_STATS, asyncio.Queue())
        await self._sock.send(self._codec.encode(GetStats()))
        return await self._next(q, "stats")

    async def stream(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Delta | Done]:
        """Yields each Delta as it comes, then the final Done; raises NoriaError on an error."""
        rid = request_id or f"{self._prefix}{next(self._ids)}"
        if rid in self._queues:
            raise NoriaError(ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is already in flight")
        fields = msgspec.structs.asdict(params or SamplingParams())
        if isinstance(prompt, str):
            fields["prompt"] = prompt
        elif prompt is not None:
            fields["prompt_token_ids"] = list(prompt)
        msg = Generate(request_id=rid, messages=messages, priority=priority, **fields)
        self._ensure_reader()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            await self._sock.send(self._codec.encode(msg))
            while True:
                out = await self._next(q, f"request {rid}")
                if isinstance(out, Error):
                    finished = True
                    raise NoriaError(out.code, out.message)
                yield out
                if isinstance(out, Done):
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                # The caller stopped listening (break, cancel, timeout): free the engine's work.
                with contextlib.suppress(zmq.ZMQError):
                    await self._sock.send(self._codec.encode(Abort(request_id=rid)))

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        n = (params or SamplingParams()).n
        texts, ids = [""] * n, [[] for _ in range(n)]
        lps: list[list[Logprob] | None] = [None] * n
        done: Done | None = None
        rid = request_id
        async for out in self.stream(prompt, params, messages=messages, request_id=request_id, priority=priority):
            rid = out.request_id
            if isinstance(out, Delta):
                texts[out.index] += out.text
                ids[out.index].extend(out.token_ids)
                if out.logprobs:
                    lps[out.index] = (lps[out.index] or []) + out.logprobs
            else:
                done = out
        assert done is not None
        reasons = done.finish_reasons or [done.finish_reason]
        return RequestOutput(
            request_id=rid or "",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=done.prompt_token_ids or [],
            outputs=[
                CompletionOutput(index=i, text=texts[i], token_ids=ids[i], finish_reason=reasons[i], logprobs=lps[i])
                for i in range(n)
            ],
        )

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return await self.generate(None, params, messages=messages, **kw)

    async def abort(self, request_id: str) -> None:
        await self._sock.send(self._codec.encode(Abort(request_id=request_id)))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Blocking client; many requests may be in flight from several threads."""

    def __init__(self, address: str = "tcp://127.0.0.1:5555", *, timeout: float | None = 60.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="noria-client", daemon=True)
        self._thread.start()
        self._async = self._call(_make_async(address, timeout))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def hello(self) -> Ready:
        return self._call(self._async.hello())

    def stats(self) -> Stats:
        return self._call(self._async.stats())

    def generate(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return self._call(self._async.generate(prompt, params, **kw))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return self._call(self._async.chat(messages, params, **kw))

    def stream(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, **kw: Any) -> Iterator[Delta | Done]:
        agen = self._async.stream(prompt, params, **kw)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def abort(self, request_id: str) -> None:
        self._call(self._async.abort(request_id))

    def close(self) -> None:
        async def _close() -> None:
            self._async.close()

        self._call(_close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _make_async(address: str, timeout: float | None) -> AsyncClient:
    return AsyncClient(address, timeout=timeout)
