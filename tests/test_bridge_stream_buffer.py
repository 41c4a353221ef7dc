"""What counts against --stream-buffer (a client that does not read) and what does not (a burst
the bridge had not yet had the chance to pass on): the SSE surfaces' Fanout and the websocket's
StreamSession."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from noria.frontend.bridge.fanout import Fanout
from noria.frontend.bridge.limits import delta_bytes
from noria.frontend.bridge.websocket import StreamSession
from noria.protocol.client import Delta, Done, Generate, Usage

BUFFER = 4096
DELTA = Delta(request_id="r", text="x" * 1000, token_ids=[7])
BURST = 3 * BUFFER // delta_bytes(DELTA)  # deltas: three buffers' worth


class _Gateway:
    """Each request's stream reads from a queue the test fills; `closed` counts the streams
    closed (the Fanout aborting a request upstream closes its stream)."""

    def __init__(self) -> None:
        self.queues: list[asyncio.Queue[Delta | Done | None]] = []
        self.closed = 0
        self.started = asyncio.Event()

    async def stream(self, request: Generate) -> AsyncIterator[Delta | Done]:
        q: asyncio.Queue[Delta | Done | None] = asyncio.Queue()
        self.queues.append(q)
        self.started.set()
        try:
            while (item := await q.get()) is not None:
                yield item
        finally:
            self.closed += 1


def _fanout(gateway: _Gateway, n: int = 1) -> Fanout:
    return Fanout(gateway, [Generate(request_id=f"r{i}", prompt=f"p{i}") for i in range(n)],
                  BUFFER)  # type: ignore[arg-type]


def _burst(gateway: _Gateway, count: int) -> None:
    """Deltas queued at once: the pumps take them all in one turn of the loop."""
    for _ in range(count):
        gateway.queues[0].put_nowait(DELTA)


def test_a_burst_that_lands_while_the_reader_waits_is_taken_whole() -> None:
    async def run() -> None:
        gateway = _Gateway()
        fan = _fanout(gateway)
        await gateway.started.wait()
        first = asyncio.ensure_future(fan.next_batch())  # before its first batch: headers not sent
        await asyncio.sleep(0)
        _burst(gateway, BURST)
        assert len(await first) == BURST and not fan.overflowed
        second = asyncio.ensure_future(fan.next_batch())  # waiting again, mid-stream
        await asyncio.sleep(0)
        _burst(gateway, BURST)
        assert len(await second) == BURST and not fan.overflowed
        gateway.queues[0].put_nowait(Done(request_id="r", finish_reason="length",
                                         usage=Usage(prompt_tokens=1, completion_tokens=2 * BURST)))
        assert [type(e) for _, e in await fan.next_batch()] == [Done]
        assert await fan.next_batch() == []

    asyncio.run(run())


def test_a_reader_away_past_the_buffer_overflows_and_every_request_is_aborted() -> None:
    async def run() -> None:
        gateway = _Gateway()
        fan = _fanout(gateway, n=3)
        overflowed = asyncio.Event()
        held: list[int] = []
        fan.on_overflow = lambda n: (held.append(n), overflowed.set())
        while len(gateway.queues) < 3:
            await gateway.started.wait()
            gateway.started.clear()
        _burst(gateway, 1)
        assert len(await fan.next_batch()) == 1
        # The reader is away now (as while its write waits on a client that takes nothing).
        _burst(gateway, BURST)
        await asyncio.wait_for(overflowed.wait(), 60)  # bounds a hang only
        assert fan.overflowed and held and held[0] > BUFFER
        assert await fan.next_batch() == []
        while gateway.closed < 3:  # cancelled pumps close their streams as the loop runs them
            await asyncio.sleep(0)

    asyncio.run(run())


class _Socket:
    """A websocket whose sends wait on `taking` (a client that reads when it is set)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.taking = asyncio.Event()
        self.waiting = asyncio.Event()  # a send waits on the client

    async def send_frame(self, frame: bytes, kind: object) -> None:
        self.waiting.set()
        await self.taking.wait()
        self.frames.append(frame)


def test_a_websocket_burst_while_the_writer_is_woken_is_sent_and_a_stalled_client_overflows() -> None:
    async def run() -> None:
        ws = _Socket()
        ws.taking.set()
        session = StreamSession(ws, _Gateway(), buffer=BUFFER)  # type: ignore[arg-type]
        overflowed: list[int] = []
        session.on_overflow = overflowed.append
        writer = asyncio.ensure_future(session._write())
        for _ in range(BURST):  # no await yields to the writer between these
            await session.send(DELTA)
        while len(ws.frames) < BURST:
            await asyncio.sleep(0)
        assert not overflowed and not session.broken
        ws.taking.clear(), ws.waiting.clear()
        await session.send(DELTA)
        await ws.waiting.wait()  # the writer waits on a client that takes nothing
        with pytest.raises(ConnectionResetError):
            for _ in range(BURST):
                await session.send(DELTA)
        assert session.broken and overflowed and overflowed[0] > BUFFER
        writer.cancel()

    asyncio.run(run())
