"""The ZeroMQ client library: `AsyncClient` (asyncio; `noria.frontend.async_client`) and
`Client` (blocking; here).

Many requests share one connection (`noria.frontend.connection`: the socket
loop, heartbeat and reconnect); `AsyncClient` is the request API on top of it.
`Client` runs an `AsyncClient` on a private uvloop thread, so both share one
implementation.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from noria.frontend.async_client import AsyncClient
from noria.frontend.connection import ENGINE_UNREACHABLE
from noria.frontend.inputs import Prompt, make_generate
from noria.frontend.outputs import RequestOutput
from noria.protocol.client import Delta, Done, Ready, Stats, Tokenized
from noria.protocol.sampling import SamplingParams

# Re-exported: other modules and older callers import them from here.
__all__ = ["ENGINE_UNREACHABLE", "AsyncClient", "Client", "make_generate"]

T = TypeVar("T")


class Client:
    """Blocking client; many requests may be in flight from several threads."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float | None = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        curve_keys: str | os.PathLike[str] | None = None,
    ) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="noria-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            address, timeout=timeout, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
            curve_keys=curve_keys,
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

    def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return self._call(self._async.generate(prompt, params, **kw))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        return self._call(self._async.chat(messages, params, **kw))

    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None, **kw: Any) -> Iterator[Delta | Done]:
        agen = self._async.stream(prompt, params, **kw)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def embed(self, inputs: Prompt | list[Prompt], **kw: Any) -> list[list[float]]:
        return self._call(self._async.embed(inputs, **kw))

    def tokenize(self, prompt: str | None = None, **kw: Any) -> Tokenized:
        return self._call(self._async.tokenize(prompt, **kw))

    def detokenize(self, tokens: list[int]) -> str:
        return self._call(self._async.detokenize(tokens))

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
