"""The ZeroMQ client library: `AsyncClient` (asyncio) and `Client` (blocking).

One DEALER socket carries many requests; replies are routed to each request's
inbox by request_id. The socket is read straight from the event loop
(`add_reader` on ZeroMQ's notification fd, drained in batches), so there is no
per-message future or thread hop; this is what keeps it fast under uvloop.

Liveness: a heartbeat (`hello`) goes out whenever the server has been quiet
for `heartbeat_interval`; a dropped connection (socket monitor) or
`heartbeat_timeout` seconds of silence marks the engine unreachable: every
request in flight fails with `engine_unreachable`, the socket is recreated
(so no stale request is replayed to a restarted server) and probing goes on
until the server answers again. `Client` runs an `AsyncClient` on a private
uvloop thread, so both share one implementation.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import aclosing
from typing import Any, TypeVar

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from noria.frontend.outputs import CompletionOutput, RequestOutput
from noria.protocol.client import (
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
from noria.protocol.codec import Codec
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import SamplingParams

T = TypeVar("T")

# Client-side only, like `timeout`: the connection dropped or the server stopped
# answering heartbeats. Never sent over the wire.
ENGINE_UNREACHABLE = ErrorCode.ENGINE_UNREACHABLE

_CONNECTING, _UP, _DOWN, _CLOSED = "connecting", "up", "down", "closed"


class _Inbox:
    """One request's replies: a deque plus at most one waiting reader."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Delta | Done | Error] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, msg: Delta | Done | Error) -> None:
        self.items.append(msg)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> Delta | Done | Error | None:
        """The next reply, or None when `timeout` passed without one."""
        if not self.items:
            fut = self.waiter = loop.create_future()
            handle = None if timeout is None else loop.call_later(timeout, _expire, fut)
            try:
                await fut
            finally:
                self.waiter = None
                if handle is not None:
                    handle.cancel()
            if not self.items:
                return None
        return self.items.popleft()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class AsyncClient:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float | None = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
    ) -> None:
        """`timeout`: seconds to wait for each message of a request before raising
        NoriaError("timeout"); None waits as long as the heartbeat says the engine
        is alive. `heartbeat_timeout`: seconds of silence (despite probes) after
        which the engine counts as unreachable."""
        self.address = address
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.ready: Ready | None = None  # the latest `ready`, once the server answered
        self._ctx = zmq.Context()
        self._codec: Codec[ServerToClient] = Codec(ServerToClient)
        self._inboxes: dict[str, _Inbox] = {}
        self._hello_waiters: list[asyncio.Future[Ready]] = []
        self._stats_waiters: list[asyncio.Future[Stats]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._drain_pending = False
        self._state = _CONNECTING
        self._down_reason = ""
        self._last_heard = 0.0
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid():x}{id(self) & 0xFFFF:x}-"

    # ---- connection -------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True once the server has answered and nothing says it has gone since."""
        return self._state == _UP

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            if self._state == _CLOSED:
                raise NoriaError(ENGINE_UNREACHABLE, "the client is closed")
            self._loop = loop
            self._last_heard = loop.time()
            self._open_socket()
            self._heartbeat = loop.create_task(self._heartbeat_loop())
        elif self._loop is not loop:
            raise RuntimeError("an AsyncClient is bound to the event loop it was first used on")
        elif self._state == _CLOSED:
            raise NoriaError(ENGINE_UNREACHABLE, "the client is closed")
        return loop

    def _open_socket(self) -> None:
        assert self._loop is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Unbounded queues: flow is bounded by the engine's own budgets.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock, self._monitor = sock, monitor
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        self._loop.add_reader(monitor.getsockopt(zmq.FD), self._on_monitor)
        # ZeroMQ's fd only signals changes: whatever is already pending needs one look.
        self._loop.call_soon(self._on_monitor)
        self._schedule_drain()

    def _close_socket(self) -> None:
        sock, monitor = self._sock, self._monitor
        self._sock = self._monitor = None
        if sock is None or monitor is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.getsockopt(zmq.FD))
            self._loop.remove_reader(monitor.getsockopt(zmq.FD))
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)

    def _send(self, msg: Generate | Abort | Hello | GetStats) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # cannot queue (socket being replaced): the heartbeat notices
        # A send can swallow ZeroMQ's edge-triggered "readable" signal: look again.
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_pending and self._loop is not None:
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_pending = False
        sock = self._sock
        while sock is not None and sock is self._sock:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                msg = self._codec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Delta | Done | Error | Ready | Stats) -> None:
        assert self._loop is not None
        self._last_heard = self._loop.time()
        if self._state != _UP:
            self._state = _UP
        if isinstance(msg, Ready):
            self.ready = msg
            waiters, self._hello_waiters = self._hello_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(msg)
        elif isinstance(msg, Stats):
            swaiters, self._stats_waiters = self._stats_waiters, []
            for sw in swaiters:
                if not sw.done():
                    sw.set_result(msg)
        elif msg.request_id is not None:
            inbox = self._inboxes.get(msg.request_id)
            if inbox is not None:
                inbox.put(msg)

    def _on_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        lost = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.Again, zmq.ZMQError):
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self._send(Hello())  # learn at once that the server is there
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                lost = True
        if lost:
            self._drain()  # replies that arrived before the drop are still good
            self._go_down(f"lost the connection to {self.address}")

    def _go_down(self, reason: str) -> None:
        """Fail everything in flight; start over on a fresh socket.

        The old socket is dropped so that queued requests are not replayed to a
        restarted server, which would run them for nobody.
        """
        if self._state in (_DOWN, _CLOSED):
            return
        self._state = _DOWN
        self._down_reason = reason
        self._fail_all(ENGINE_UNREACHABLE, reason)
        self._close_socket()
        self._open_socket()

    def _fail_all(self, code: str, reason: str) -> None:
        inboxes, self._inboxes = self._inboxes, {}
        for rid, inbox in inboxes.items():
            inbox.put(Error(request_id=rid, code=code, message=f"{reason}; request {rid} was lost"))
        swaiters, self._stats_waiters = self._stats_waiters, []
        for w in swaiters:
            if not w.done():
                w.set_exception(NoriaError(code, reason))

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            # A safety net, should an fd edge ever be missed.
            self._on_monitor()
            self._drain()
            silent = loop.time() - self._last_heard
            if silent >= self.heartbeat_interval:
                self._send(Hello())
            if silent >= self.heartbeat_timeout and self._state != _DOWN:
                self._go_down(f"no answer from {self.address} for {silent:.1f}s")

    def _check_up(self) -> None:
        if self._state == _DOWN:
            raise NoriaError(ENGINE_UNREACHABLE, f"{self._down_reason} (retrying in the background)")

    # ---- requests ---------------------------------------------------------

    async def connect(self) -> None:
        """Bind to the running loop and start connecting; returns at once.

        Optional: every call does it on first use. A long-lived client (the
        bridge) calls it so that its heartbeat runs before the first request."""
        self._start()

    async def hello(self) -> Ready:
        """Ask the server who it is. Also waits (up to `timeout`) for an unreachable one to come back."""
        loop = self._start()
        fut: asyncio.Future[Ready] = loop.create_future()
        self._hello_waiters.append(fut)
        self._send(Hello())
        return await self._await(fut, "hello")

    async def stats(self) -> Stats:
        """The engine's latest stats (running/waiting requests, KV usage, counters)."""
        loop = self._start()
        self._check_up()
        fut: asyncio.Future[Stats] = loop.create_future()
        self._stats_waiters.append(fut)
        self._send(GetStats())
        return await self._await(fut, "stats")

    async def _await(self, fut: asyncio.Future[T], what: str) -> T:
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for {what} within {self.timeout}s") from None

    def new_request_id(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    async def stream_request(self, msg: Generate) -> AsyncIterator[Delta | Done]:
        """Send a ready-made `generate`; yield each Delta as it comes, then the Done.

        Raises NoriaError on an error reply, a timeout or a lost engine. Leaving
        the iteration early (break, cancel, timeout) aborts the request upstream.
        """
        loop = self._start()
        rid = msg.request_id
        if rid in self._inboxes:
            raise NoriaError(ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is already in flight")
        self._check_up()
        inbox = self._inboxes[rid] = _Inbox()
        finished = False
        try:
            self._send(msg)
            while True:
                out = await inbox.get(loop, self.timeout)
                if out is None:
                    raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for request {rid} within {self.timeout}s")
                if isinstance(out, Error):
                    finished = True
                    raise NoriaError(out.code, out.message)
                yield out
                if isinstance(out, Done):
                    finished = True
                    return
        finally:
            if self._inboxes.get(rid) is inbox:
                del self._inboxes[rid]
            if not finished and self._state != _DOWN:
                # The caller stopped listening: free the engine's work. Synchronous,
                # so that it also happens inside a cancelled task.
                self._send(Abort(request_id=rid))

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
        msg = make_generate(request_id or self.new_request_id(), prompt, params, messages=messages, priority=priority)
        async with aclosing(self.stream_request(msg)) as upstream:
            async for out in upstream:
                yield out

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
        texts: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[Logprob] | None] = [None] * n
        done: Done | None = None
        rid = request_id or self.new_request_id()
        msg = make_generate(rid, prompt, params, messages=messages, priority=priority)
        async with aclosing(self.stream_request(msg)) as upstream:
            async for out in upstream:
                if isinstance(out, Delta):
                    texts[out.index].append(out.text)
                    ids[out.index].extend(out.token_ids)
                    if out.logprobs:
                        lps[out.index] = (lps[out.index] or []) + out.logprobs
                else:
                    done = out
        assert done is not None
        reasons = done.finish_reasons or [done.finish_reason]
        return RequestOutput(
            request_id=rid,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=done.prompt_token_ids or [],
            outputs=[
                CompletionOutput(index=i, text="".join(texts[i]), token_ids=ids[i], finish_reason=reasons[i], logprobs=lps[i])
                for i in range(n)
            ],
        )

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return await self.generate(None, params, messages=messages, **kw)

    async def abort(self, request_id: str) -> None:
        """Abort a request of this client; it ends with a `done` whose finish_reason is "abort"."""
        self._start()
        self._send(Abort(request_id=request_id))

    def close(self) -> None:
        """Fail what is in flight and release the socket. Call it on the client's loop."""
        if self._state == _CLOSED:
            return
        self._state = _CLOSED
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._fail_all(ENGINE_UNREACHABLE, "the client was closed")
        self._close_socket()
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def make_generate(
    request_id: str,
    prompt: str | list[int] | None,
    params: SamplingParams | None,
    *,
    messages: list[dict[str, Any]] | None = None,
    priority: int = 0,
) -> Generate:
    fields = msgspec.structs.asdict(params or SamplingParams())
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif prompt is not None:
        fields["prompt_token_ids"] = list(prompt)
    return Generate(request_id=request_id, messages=messages, priority=priority, **fields)


class Client:
    """Blocking client; many requests may be in flight from several threads."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float | None = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
    ) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="noria-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            address, timeout=timeout, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout
        )

    @property
    def connected(self) -> bool:
        return self._async.connected

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
        if self._loop.is_closed():
            return

        async def _close() -> None:
            self._async.close()

        self._call(_close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
