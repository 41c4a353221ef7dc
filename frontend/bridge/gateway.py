"""The bridge's one way upstream: requests go through here so that each is timed.

The bridge sees every delta arrive, so time to first token, inter-token
latency and end-to-end latency are measured here and not in the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from noria.frontend.bridge.metrics import BridgeMetrics
from noria.frontend.client import ENGINE_UNREACHABLE, AsyncClient
from noria.protocol.client import Delta, Done, Embed, Embedding, Generate, Ready, Stats
from noria.protocol.errors import NoriaError


class Gateway:
    def __init__(self, client: AsyncClient, metrics: BridgeMetrics) -> None:
        self.client = client
        self.metrics = metrics
        # Streams whose consumer has not yet finished with them: at shutdown the bridge waits
        # for these, or the finals the engine already sent would die with the sockets.
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def new_id(self) -> str:
        return self.client.new_request_id()

    async def ready(self, timeout: float = 2.0) -> Ready:
        """The engine's `ready` (model name, lengths); asks for it if not known yet."""
        if self.client.ready is not None and self.client.connected:
            return self.client.ready
        try:
            return await asyncio.wait_for(self.client.hello(), timeout)
        except TimeoutError:
            raise NoriaError(ENGINE_UNREACHABLE, f"no answer from {self.client.address} within {timeout}s") from None

    async def stats(self, timeout: float = 2.0) -> Stats:
        """The engine's latest stats; TimeoutError when it does not answer within `timeout`."""
        return await asyncio.wait_for(self.client.stats(), timeout)

    async def embed(self, msg: Embed) -> Embedding:
        """One `embed` upstream, timed and counted as a request (finish reason "stop"); cancelled,
        it aborts the request upstream."""
        m = self.metrics
        t0 = time.perf_counter()
        self.active += 1
        self.idle.clear()
        try:
            out = await self.client.embed_request(msg)
        except NoriaError as e:
            m.failure.labels(e.code).inc()
            raise
        except asyncio.CancelledError:
            m.success.labels("abort").inc()
            raise
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()
        m.e2e.observe(time.perf_counter() - t0)
        m.success.labels("stop").inc()
        return out

    async def stream(self, msg: Generate) -> AsyncIterator[Delta | Done]:
        m = self.metrics
        t0 = time.perf_counter()
        first, ended = True, False
        last: dict[int, float] = {}
        self.active += 1
        self.idle.clear()
        try:
            # aclosing: leaving early must close the upstream stream now (it aborts the request).
            async with aclosing(self.client.stream_request(msg)) as upstream:
                async for out in upstream:
                    now = time.perf_counter()
                    if isinstance(out, Delta):
                        if out.token_ids:
                            prev = last.get(out.index)
                            if first:
                                m.ttft.observe(now - t0)
                                first = False
                            elif prev is not None:
                                m.itl.observe((now - prev) / len(out.token_ids))
                            last[out.index] = now
                    else:
                        ended = True
                        m.e2e.observe(now - t0)
                        m.success.labels(out.finish_reason).inc()
                        m.prompt_len.observe(out.usage.prompt_tokens)
                        m.output_len.observe(out.usage.completion_tokens)
                    yield out
        except NoriaError as e:
            ended = True
            m.failure.labels(e.code).inc()
            raise
        finally:
            if not ended:  # the client went away: the request was aborted upstream
                m.success.labels("abort").inc()
            self.active -= 1
            if not self.active:
                self.idle.set()
