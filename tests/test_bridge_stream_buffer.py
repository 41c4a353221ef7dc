"""What counts against an SSE stream's --stream-buffer (the Fanout): a client that does not read,
and not a burst that landed before the stream's first batch (its headers not yet sent)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from noria.frontend.bridge.fanout import Fanout
from noria.frontend.bridge.limits import delta_bytes
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


def test_a_burst_before_the_first_batch_is_taken_whole() -> None:
    async def run() -> None:
        gateway = _Gateway()
        fan = _fanout(gateway)
        await gateway.started.wait()
        _burst(gateway, BURST)  # before the reader has run: its headers are not sent yet
        while not gateway.queues[0].empty():  # the pump takes it all
            await asyncio.sleep(0)
        assert len(await fan.next_batch()) == BURST and not fan.overflowed
        gateway.queues[0].put_nowait(Done(request_id="r", finish_reason="length",
                                         usage=Usage(prompt_tokens=1, completion_tokens=BURST)))
        assert [type(e) for _, e in await fan.next_batch()] == [Done]
        assert await fan.next_batch() == []

    asyncio.run(run())


def test_past_the_buffer_after_the_first_batch_it_overflows_and_every_request_is_aborted() -> None:
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
        # The reader has its first batch and is away (as while its write waits on a client that
        # takes nothing).
        _burst(gateway, BURST)
        await asyncio.wait_for(overflowed.wait(), 60)  # bounds a hang only
        assert fan.overflowed and held and held[0] > BUFFER
        assert await fan.next_batch() == []
        while gateway.closed < 3:  # cancelled pumps close their streams as the loop runs them
            await asyncio.sleep(0)

    asyncio.run(run())

