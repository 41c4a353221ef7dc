"""`ws://HOST:PORT/v1/stream`: the ZMQ client protocol as JSON text, many requests per socket.

Each request gets its own relay task and a fresh upstream request id (clients
of different sockets may all call theirs "r1"); replies go back under the
client's id. A socket that closes cancels its relays, and a cancelled relay
aborts its request upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import aclosing

import msgspec
from aiohttp import WSMsgType, web

from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.state import GATEWAY, LIMIT, WEBSOCKETS
from noria.protocol.client import Abort, Delta, Done, Error, Generate
from noria.protocol.errors import ErrorCode, NoriaError

_decoder = msgspec.json.Decoder(Generate | Abort)
_encoder = msgspec.json.Encoder()
_rid_of = msgspec.json.Decoder(dict)


class StreamSession:
    def __init__(self, ws: web.WebSocketResponse, gateway: Gateway, limit: int = 0) -> None:
        self.ws = ws
        self.gateway = gateway
        self.limit = limit  # requests in flight on this socket, at most (0: no cap)
        self.relays: dict[str, tuple[str, asyncio.Task[None]]] = {}  # client id -> (upstream id, task)

    async def send(self, msg: Delta | Done | Error) -> None:
        await self.ws.send_frame(_encoder.encode(msg), WSMsgType.TEXT)

    async def run(self) -> None:
        try:
            async for frame in self.ws:
                if frame.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self.on_message(frame.data)
                elif frame.type == WSMsgType.ERROR:
                    break
        except ConnectionError:
            pass  # closed while we answered; the relays are cancelled below
        finally:
            await self.cancel_all()

    async def on_message(self, data: bytes | str) -> None:
        try:
            msg = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.send(Error(request_id=_request_id_of(data), code=ErrorCode.INVALID_MESSAGE, message=str(e)))
            return
        rid = msg.request_id
        if isinstance(msg, Abort):
            entry = self.relays.get(rid)
            if entry is not None:
                await self.gateway.client.abort(entry[0])
            return
        if not rid:
            await self.send(Error(request_id=rid, code=ErrorCode.INVALID_REQUEST, message="request_id must be a non-empty string"))
        elif rid in self.relays:
            await self.send(Error(request_id=rid, code=ErrorCode.DUPLICATE_REQUEST,
                                  message=f"request_id {rid!r} is already in flight on this socket"))
        elif self.limit and len(self.relays) >= self.limit:
            await self.send(Error(request_id=rid, code=ErrorCode.OVERLOADED, message=f"this socket already has "
                                  f"{self.limit} requests in flight, its limit; retry later"))
        else:
            upstream = msgspec.structs.replace(msg, request_id=self.gateway.new_id())
            task = asyncio.get_running_loop().create_task(self.relay(rid, upstream))
            self.relays[rid] = (upstream.request_id, task)

    async def relay(self, rid: str, upstream: Generate) -> None:
        try:
            async with aclosing(self.gateway.stream(upstream)) as outs:
                async for out in outs:
                    await self.send(msgspec.structs.replace(out, request_id=rid))
        except NoriaError as e:
            with contextlib.suppress(ConnectionError):
                await self.send(Error(request_id=rid, code=e.code, message=e.message))
        except ConnectionError:
            pass  # the socket closed under us; leaving the loop aborted the request upstream
        finally:
            entry = self.relays.get(rid)
            if entry is not None and entry[0] == upstream.request_id:
                del self.relays[rid]

    async def cancel_all(self) -> None:
        tasks = [t for _, t in self.relays.values()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _request_id_of(data: bytes | str) -> str | None:
    try:
        raw = _rid_of.decode(data)
    except msgspec.DecodeError:
        return None
    rid = raw.get("request_id")
    return rid if isinstance(rid, str) else None


async def handle_stream(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(compress=False, decode_text=False, heartbeat=30.0, max_msg_size=64 * 2**20)
    await ws.prepare(request)
    sockets = request.app[WEBSOCKETS]
    sockets.add(ws)
    try:
        await StreamSession(ws, request.app[GATEWAY], request.app[LIMIT]).run()
    finally:
        sockets.discard(ws)
    return ws
