"""One DEALER connection to a noria server: the socket loop, heartbeat and reconnect.

Replies are routed to each request's inbox by request_id. The socket is read
straight from the event loop (`add_reader` on ZeroMQ's notification fd, drained
in batches), so there is no per-message future or thread hop; this is what
keeps it fast under uvloop.

Liveness: a heartbeat (`hello`) goes out whenever the server has been quiet
for `heartbeat_interval`; a dropped connection (socket monitor) or
`heartbeat_timeout` seconds of silence marks the engine unreachable: every
request in flight fails with `engine_unreachable`, the socket is recreated
(so no stale request is replayed to a restarted server) and probing goes on
until the server answers again.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from noria.protocol.client import (
    Abort,
    Delta,
    Done,
    Embed,
    Embedding,
    Error,
    Generate,
    GetStats,
    Hello,
    Ready,
    ServerToClient,
    Stats,
)
from noria.protocol.codec import Codec
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.security import apply_curve_client
from noria.protocol.sockets import CLIENT_HWM, MAX_CLIENT_MESSAGE, backoff_reconnects, make_socket

# Client-side only, like `timeout`: the connection dropped or the server stopped
# answering heartbeats. Never sent over the wire.
ENGINE_UNREACHABLE = ErrorCode.ENGINE_UNREACHABLE

_CONNECTING, _UP, _DOWN, _CLOSED = "connecting", "up", "down", "closed"

Reply = Delta | Done | Error | Embedding


class Inbox:
    """One request's replies: a deque plus at most one waiting reader."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Reply] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, msg: Reply) -> None:
        self.items.append(msg)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> Reply | None:
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


class Connection:
    """Bound to the event loop it is first started on; every method runs on that loop."""

    def __init__(self, address: str, *, heartbeat_interval: float, heartbeat_timeout: float,
                 curve_keys: str | os.PathLike[str] | None = None, relay: bool = False) -> None:
        self.address = address
        self._hello = Hello(relay=relay)
        self.curve_keys = curve_keys
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.ready: Ready | None = None  # the latest `ready`, once the server answered
        self._ctx = zmq.Context()
        self._codec: Codec[ServerToClient] = Codec(ServerToClient)
        self._inboxes: dict[str, Inbox] = {}
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

    @property
    def connected(self) -> bool:
        """True once the server has answered and nothing says it has gone since."""
        return self._state == _UP

    @property
    def down(self) -> bool:
        """True while the engine counts as unreachable (until the server answers again)."""
        return self._state == _DOWN

    def start(self) -> asyncio.AbstractEventLoop:
        """Bind to the running loop on first use (opening the socket); returns that loop."""
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

    def check_up(self) -> None:
        """Raise `engine_unreachable` at once while the engine is known to be gone."""
        if self._state == _DOWN:
            raise NoriaError(ENGINE_UNREACHABLE, f"{self._down_reason} (retrying in the background)")

    # ---- what the request API asks of the connection ---------------------

    def open_inbox(self, request_id: str) -> Inbox:
        if request_id in self._inboxes:
            raise NoriaError(ErrorCode.DUPLICATE_REQUEST, f"request_id {request_id!r} is already in flight")
        self.check_up()
        inbox = self._inboxes[request_id] = Inbox()
        return inbox

    def close_inbox(self, request_id: str, inbox: Inbox) -> None:
        if self._inboxes.get(request_id) is inbox:
            del self._inboxes[request_id]

    def ask_hello(self) -> asyncio.Future[Ready]:
        assert self._loop is not None
        fut: asyncio.Future[Ready] = self._loop.create_future()
        self._hello_waiters.append(fut)
        self.send(self._hello)
        return fut

    def ask_stats(self) -> asyncio.Future[Stats]:
        assert self._loop is not None
        self.check_up()
        fut: asyncio.Future[Stats] = self._loop.create_future()
        self._stats_waiters.append(fut)
        self.send(GetStats())
        return fut

    def send(self, msg: Generate | Embed | Abort | Hello | GetStats) -> None:
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

    # ---- the socket ------------------------------------------------------

    def _open_socket(self) -> None:
        assert self._loop is not None
        monitors: list[zmq.Socket] = []

        def setup(sock: zmq.Socket) -> None:
            backoff_reconnects(sock)
            if self.curve_keys is not None:
                apply_curve_client(sock, self.curve_keys)
            # Before the connect, so that the first EVENT_CONNECTED is seen.
            monitors.append(sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED))

        # Sending never drops: what this client queues is its caller's to bound. Receiving is
        # bounded like the server's side (a reader that stops reading is dropped by the
        # server), and no frame from the server may exceed the client-facing maximum.
        sock = make_socket(self._ctx, zmq.DEALER, self.address, bind=False, hwm=CLIENT_HWM, send_hwm=0,
                           max_msg_size=MAX_CLIENT_MESSAGE, setup=setup)
        monitor = monitors[0]
        self._sock, self._monitor = sock, monitor
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        self._loop.add_reader(monitor.getsockopt(zmq.FD), self._on_monitor)
        # ZeroMQ's fd only signals changes: whatever is already pending needs one look.
        self._loop.call_soon(self._on_monitor)
        self._schedule_drain()
        if self._hello.relay:
            # First in the new socket's queue: the server knows the connection for a relay
            # before any request of it arrives.
            self.send(self._hello)

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
            except zmq.ZMQError:  # zmq.Again included: nothing more for now
                return
            try:
                msg = self._codec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Delta | Done | Error | Embedding | Ready | Stats) -> None:
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

    # ---- liveness --------------------------------------------------------

    def _on_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        lost = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:  # zmq.Again included
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self.send(self._hello)  # learn at once that the server is there
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
            # A relay says so in every heartbeat: the server keeps only the latest relays.
            if silent >= self.heartbeat_interval or self._hello.relay:
                self.send(self._hello)
            if silent >= self.heartbeat_timeout and self._state != _DOWN:
                self._go_down(f"no answer from {self.address} for {silent:.1f}s")
