"""Run several upstream requests (one per prompt of a batch) as one merged stream."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from contextlib import aclosing

from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.limits import delta_bytes
from noria.protocol.client import Delta, Done, Generate
from noria.protocol.errors import ErrorCode, NoriaError

log = logging.getLogger("noria.bridge")

Event = tuple[int, Delta | Done | NoriaError]  # (prompt index, what came)


class Fanout:
    """Events from all requests in arrival order; `close()` aborts what is still running.

    `buffer`: bytes of deltas (about: `delta_bytes`) it may hold that its reader has not
    taken; past them it overflows: every request is aborted upstream, nothing more is kept,
    and `on_overflow(bytes held)` is called. 0: no bound (a whole response is built anyway).
    The engine never waits for a slow reader: this bound is what keeps its output in check.
    Deltas count from the reader's first batch on: a burst that lands before the reader has
    run (the bridge's process held off its core while the engine ran on) is not the client's
    doing, and counting it would drop a client before its headers went out."""

    def __init__(self, gateway: Gateway, requests: list[Generate], buffer: int = 0) -> None:
        # A deque and one waiter, not an asyncio.Queue: every queued HTTP request holds one of
        # these, and a Queue's four deques and Event cost ~1.5 KiB each (measured: the bridge's RSS
        # under floods of queued streams).
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._open = len(requests)
        self._buffer = buffer
        self._held = 0
        self._taken = False  # the reader has had a batch
        self.overflowed = False
        self.on_overflow: Callable[[int], None] | None = None
        self._loop = loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(gateway, i, r)) for i, r in enumerate(requests)]

    def _put(self, event: Event) -> None:
        if self.overflowed:
            return
        if self._buffer and isinstance(event[1], Delta) and self._taken:
            self._held += delta_bytes(event[1])
            if self._held > self._buffer:
                self._overflow()
                return
        self._events.append(event)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _pump(self, gateway: Gateway, index: int, request: Generate) -> None:
        put = self._put
        try:
            async with aclosing(gateway.stream(request)) as outs:
                async for out in outs:
                    put((index, out))
        except NoriaError as e:
            put((index, e))
        except Exception as e:  # a bug must end this prompt with an error, not leave the response waiting
            log.exception("internal error relaying a request")
            put((index, NoriaError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:500])))

    async def next_batch(self) -> list[Event]:
        """At least one event (everything already queued, so writes can be coalesced);
        an empty list once every request has ended."""
        while not self._events:
            if self._open == 0:
                return []
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch = list(self._events)
        self._events.clear()
        self._held = 0
        self._taken = True
        self._open -= sum(1 for _, e in batch if not isinstance(e, Delta))
        return batch

    def _overflow(self) -> None:
        self.overflowed = True
        self._events.clear()
        self._open = 0  # a reader that asks again is told it is over
        self.close()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self.on_overflow is not None:
            self.on_overflow(self._held)

    def close(self) -> None:
        # Cancelling a pump closes its upstream stream, which sends the abort.
        for t in self._tasks:
            t.cancel()
