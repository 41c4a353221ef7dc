"""`ws://HOST:PORT/v1/stream`: the ZMQ client protocol as JSON text, many requests per socket.

Each request gets its own relay task and a fresh upstream request id (clients
of different sockets may all call theirs "r1"); replies go back under the
client's id. A socket that closes cancels its relays, and a cancelled relay
aborts its request upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from contextlib import aclosing

import msgspec
from aiohttp import WSMsgType, web

from noria.frontend.bridge.errors import UNDECODABLE, BadRequest, undecodable_message
from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.limits import ClientBudgets
from noria.frontend.bridge.state import BUDGETS, GATEWAY, LIMITS, METRICS, WEBSOCKETS
from noria.protocol.client import Abort, Delta, Done, Error, Generate, Usage
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.validation import field_error

_decoder = msgspec.json.Decoder(Generate | Abort)
_encoder = msgspec.json.Encoder()
_any = msgspec.json.Decoder()
log = logging.getLogger("noria.bridge")


class _Relay:
    """One request of a socket: its upstream id, its task, and whether its `generate` has
    gone upstream yet (an abort that overtakes it must not be lost)."""

    __slots__ = ("upstream", "task", "sent", "aborted")

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.task: asyncio.Task[None] | None = None
        self.sent = False
        self.aborted = False


class StreamSession:
    """One socket. Its requests count against its client address's budget (`budgets`, `who`).

    Replies go out through one writer task, so that no relay waits on the client: a client
    that does not read lets at most `buffer` bytes of replies pile up here (0: no bound), and
    past them every request of the socket is aborted upstream and the connection dropped
    (`on_overflow(bytes held)` is told first)."""

    def __init__(self, ws: web.WebSocketResponse, gateway: Gateway, budgets: ClientBudgets | None = None,
                 who: str = "", buffer: int = 0) -> None:
        self.ws = ws
        self.gateway = gateway
        self.budgets = budgets or ClientBudgets(0)
        self.who = who
        self.relays: dict[str, _Relay] = {}  # client id -> its relay
        self.buffer = buffer
        self.outbox: deque[bytes] = deque()
        self.held = 0  # bytes in the outbox
        self.broken = False  # overflowed, or the socket failed a write: nothing more goes out
        self.on_overflow: Callable[[int], None] | None = None
        self._wake: asyncio.Event = asyncio.Event()

    async def send(self, msg: Delta | Done | Error) -> None:
        """Queue `msg` for the writer; raises ConnectionResetError once nothing can go out."""
        if self.broken:
            raise ConnectionResetError("the websocket is closing")
        frame = _encoder.encode(msg)
        self.outbox.append(frame)
        self.held += len(frame)
        if self.buffer and self.held > self.buffer:
            held = self.held
            self.broken = True
            self.outbox.clear()
            self.held = 0
            if self.on_overflow is not None:
                self.on_overflow(held)
            raise ConnectionResetError("the client does not read")
        self._wake.set()

    async def _write(self) -> None:
        outbox = self.outbox
        try:
            while True:
                while not outbox:
                    self._wake.clear()
                    await self._wake.wait()
                frame = outbox.popleft()
                self.held -= len(frame)
                # Waits while the transport holds more than its high-water mark unsent.
                await self.ws.send_frame(frame, WSMsgType.TEXT)
        except ConnectionError:
            self.broken = True

    async def run(self) -> None:
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            async for frame in self.ws:
                if frame.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    try:
                        await self.on_message(frame.data)
                    except ConnectionError:
                        raise
                    except Exception as e:  # a bug costs the message an error event, not the socket
                        log.exception("internal error on a websocket message")
                        await self.send(Error(request_id=None, code=ErrorCode.INTERNAL,
                                              message=f"internal error: {type(e).__name__}: {e}"[:500]))
                elif frame.type == WSMsgType.ERROR:
                    break
        except ConnectionError:
            pass  # closed while we answered; the relays are cancelled below
        finally:
            await self.cancel_all()
            writer.cancel()

    async def on_message(self, data: bytes | str) -> None:
        """Answer one client message; whatever is wrong with it costs that message (an
        `error` event), never the socket and the other requests on it."""
        try:
            msg = _decoder.decode(data)
        except msgspec.ValidationError as e:  # JSON, but not a message: answer under its id, naming the field
            raw = _raw(data)
            bad = field_error(Generate, raw) if isinstance(raw, dict) and raw.get("type") == "generate" else None
            await self.send(Error(request_id=_request_id_of(raw), code=ErrorCode.INVALID_MESSAGE, message=str(e),
                                  param=bad.param if bad else None))
            return
        except UNDECODABLE as e:  # not JSON, not UTF-8, nested too deeply
            await self.send(Error(request_id=None, code=ErrorCode.INVALID_MESSAGE, message=undecodable_message(e)))
            return
        rid = msg.request_id
        if isinstance(msg, Abort):
            relay = self.relays.get(rid)
            if relay is None:
                return
            if relay.sent:
                await self.gateway.client.abort(relay.upstream)
            else:  # its task has not run yet: it ends with "abort" without going upstream
                relay.aborted = True
            return
        if not rid:
            await self.send(Error(request_id=rid, code=ErrorCode.INVALID_REQUEST, message="request_id must be a non-empty string"))
        elif rid in self.relays:
            await self.send(Error(request_id=rid, code=ErrorCode.DUPLICATE_REQUEST,
                                  message=f"request_id {rid!r} is already in flight on this socket"))
        else:
            cost = max(msg.n, 1)  # a wrong n is the engine's to name
            try:
                self.budgets.take(self.who, cost)
            except BadRequest as e:
                await self.send(Error(request_id=rid, code=e.code, message=e.message, param=e.param))
                return
            upstream = msgspec.structs.replace(msg, request_id=self.gateway.new_id())
            relay = _Relay(upstream.request_id)
            self.relays[rid] = relay
            relay.task = asyncio.get_running_loop().create_task(self.relay(rid, upstream, relay))
            # A done callback: it runs even for a task cancelled before it started.
            relay.task.add_done_callback(lambda _: self.budgets.give(self.who, cost))

    async def relay(self, rid: str, upstream: Generate, relay: _Relay) -> None:
        try:
            if relay.aborted:
                await self.send(Done(request_id=rid, finish_reason="abort",
                                     usage=Usage(prompt_tokens=0, completion_tokens=0)))
                return
            # The generate goes out in the stream's first step, with no await before it: an
            # abort read after this line is sent after it, on the same connection.
            relay.sent = True
            async with aclosing(self.gateway.stream(upstream)) as outs:
                async for out in outs:
                    await self.send(msgspec.structs.replace(out, request_id=rid))
        except NoriaError as e:
            with contextlib.suppress(ConnectionError):
                await self.send(Error(request_id=rid, code=e.code, message=e.message, param=e.param))
        except ConnectionError:
            pass  # the socket closed under us; leaving the loop aborted the request upstream
        except Exception as e:  # a bug costs this request an error, not a request that never ends
            log.exception("internal error relaying a websocket request")
            with contextlib.suppress(ConnectionError):
                await self.send(Error(request_id=rid, code=ErrorCode.INTERNAL,
                                      message=f"internal error: {type(e).__name__}: {e}"[:500]))
        finally:
            if self.relays.get(rid) is relay:
                del self.relays[rid]

    async def cancel_all(self) -> None:
        tasks = [r.task for r in self.relays.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _raw(data: bytes | str) -> object:
    try:
        return _any.decode(data)
    except UNDECODABLE:
        return None


def _request_id_of(raw: object) -> str | None:
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None


async def handle_stream(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(compress=False, decode_text=False, heartbeat=30.0, max_msg_size=64 * 2**20)
    await ws.prepare(request)
    sockets = request.app[WEBSOCKETS]
    sockets.add(ws)
    app = request.app
    session = StreamSession(ws, app[GATEWAY], app[BUDGETS], request.remote or "", app[LIMITS].stream_buffer)

    def overflow(held: int) -> None:
        app[METRICS].slow_readers.labels("websocket").inc()
        log.warning("aborted websocket %s: its client left %d bytes unread, over --stream-buffer %d; its %d "
                    "request(s) aborted upstream", request.remote, held, app[LIMITS].stream_buffer, len(session.relays))
        if request.transport is not None:
            request.transport.abort()  # ends the read loop, which cancels the relays

    session.on_overflow = overflow
    try:
        await session.run()
    finally:
        sockets.discard(ws)
    return ws
