"""Run several upstream requests (one per prompt of a batch) as one merged stream."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from noria.frontend.bridge.gateway import Gateway
from noria.protocol.client import Delta, Done, Generate
from noria.protocol.errors import NoriaError

Event = tuple[int, Delta | Done | NoriaError]  # (prompt index, what came)


class Fanout:
    """Events from all requests in arrival order; `close()` aborts what is still running."""

    def __init__(self, gateway: Gateway, requests: list[Generate]) -> None:
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._open = len(requests)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(gateway, i, r)) for i, r in enumerate(requests)]

    async def _pump(self, gateway: Gateway, index: int, request: Generate) -> None:
        put = self._queue.put_nowait
        try:
            async with aclosing(gateway.stream(request)) as outs:
                async for out in outs:
                    put((index, out))
        except NoriaError as e:
            put((index, e))

    async def next_batch(self) -> list[Event]:
        """At least one event (everything already queued, so writes can be coalesced);
        an empty list once every request has ended."""
        if self._open == 0:
            return []
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        self._open -= sum(1 for _, e in batch if not isinstance(e, Delta))
        return batch

    def close(self) -> None:
        # Cancelling a pump closes its upstream stream, which sends the abort.
        for t in self._tasks:
            t.cancel()
