"""`AsyncClient`, the ZeroMQ client library's request API (asyncio): generate, stream, chat,
embed, tokenize, detokenize, abort, hello and stats over one shared connection
(`noria.frontend.connection`: the socket loop, heartbeat and reconnect). `noria.frontend.client`
exports it beside `Client`, its blocking wrapper.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from noria.frontend.connection import Connection
from noria.frontend.inputs import Prompt, make_embed, make_generate, prompt_list
from noria.frontend.outputs import OutputBuilder, RequestOutput
from noria.protocol.client import (
    Abort,
    Delta,
    Detokenize,
    Detokenized,
    Done,
    Embed,
    Embedding,
    Error,
    Generate,
    Ready,
    Stats,
    Tokenize,
    Tokenized,
)
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import SamplingParams

T = TypeVar("T")


class AsyncClient:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float | None = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        curve_keys: str | os.PathLike[str] | None = None,
        relay: bool = False,
    ) -> None:
        """`timeout`: seconds to wait for each message of a request before raising
        NoriaError("timeout"); None waits as long as the heartbeat says the engine
        is alive. `heartbeat_timeout`: seconds of silence (despite probes) after
        which the engine counts as unreachable. `curve_keys`: a folder with the server's
        public key (`scheduler.key`) and this client's pair, for a server started with
        `--zmq-curve-keys` (docs/protocol.md). `relay`: this client forwards many clients'
        requests and caps each of them itself (the bridge); the server then does not apply its
        per-connection cap to it."""
        self.timeout = timeout
        self._conn = Connection(address, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                                curve_keys=curve_keys, relay=relay)
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid():x}{id(self) & 0xFFFF:x}-"

    @property
    def address(self) -> str:
        return self._conn.address

    @property
    def heartbeat_interval(self) -> float:
        return self._conn.heartbeat_interval

    @property
    def heartbeat_timeout(self) -> float:
        return self._conn.heartbeat_timeout

    @property
    def ready(self) -> Ready | None:
        """The latest `ready`, once the server answered."""
        return self._conn.ready

    @property
    def connected(self) -> bool:
        """True once the server has answered and nothing says it has gone since."""
        return self._conn.connected

    async def connect(self) -> None:
        """Bind to the running loop and start connecting; returns at once.

        Optional: every call does it on first use. A long-lived client (the
        bridge) calls it so that its heartbeat runs before the first request."""
        self._conn.start()

    async def hello(self) -> Ready:
        """Ask the server who it is. Also waits (up to `timeout`) for an unreachable one to come back."""
        self._conn.start()
        return await self._await(self._conn.ask_hello(), "hello")

    async def stats(self) -> Stats:
        """The engine's latest stats (running/waiting requests, KV usage, counters)."""
        self._conn.start()
        return await self._await(self._conn.ask_stats(), "stats")

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
        conn = self._conn
        loop = conn.start()
        rid = msg.request_id
        inbox = conn.open_inbox(rid)
        finished = False
        try:
            try:
                _send_new(conn, msg)
            except NoriaError:
                finished = True  # nothing was sent: nothing to abort
                raise
            while True:
                out = await inbox.get(loop, self.timeout)
                if out is None:
                    raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for request {rid} within {self.timeout}s")
                if isinstance(out, Error):
                    finished = True
                    raise NoriaError(out.code, out.message, param=out.param)
                yield out
                if isinstance(out, Done):
                    finished = True
                    return
        finally:
            conn.close_inbox(rid, inbox)
            if not finished and not conn.down:
                # The caller stopped listening: free the engine's work. Synchronous,
                # so that it also happens inside a cancelled task.
                conn.send(Abort(request_id=rid))

    async def stream(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        **chat: Any,
    ) -> AsyncIterator[Delta | Done]:
        """Yields each Delta as it comes, then the final Done; raises NoriaError on an error.
        Requests with different `cache_salt`s (or a salt and none) share no prefix-cache blocks.
        `chat`: the chat template controls of `generate` (`add_generation_prompt`,
        `continue_final_message`, `chat_template`, `chat_template_kwargs`), with `messages`."""
        msg = make_generate(request_id or self.new_request_id(), prompt, params, messages=messages, priority=priority,
                            cache_salt=cache_salt, **chat)
        async with aclosing(self.stream_request(msg)) as upstream:
            async for out in upstream:
                yield out

    async def generate(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        **chat: Any,
    ) -> RequestOutput:
        """`chat`: the chat template controls, as in `stream`."""
        msg = make_generate(request_id or self.new_request_id(), prompt, params, messages=messages, priority=priority,
                            cache_salt=cache_salt, **chat)
        builder = OutputBuilder(msg.request_id, msg.prompt, msg.n)
        async with aclosing(self.stream_request(msg)) as upstream:
            async for out in upstream:
                builder.add(out)
        return builder.output()

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        """`kw`: `request_id`, `priority`, `cache_salt` and the chat template controls
        (`add_generation_prompt`, `continue_final_message`, `chat_template`, `chat_template_kwargs`)."""
        return await self.generate(None, params, messages=messages, **kw)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool | None = None,
        return_token_strs: bool = False,
        **chat: Any,
    ) -> Tokenized:
        """The token ids of a text, or of chat `messages` as the chat template renders them
        (`chat`: the template controls of `generate`, and `tools`), with the count and the
        engine's `max_model_len`; raises NoriaError naming the field at fault."""
        msg = Tokenize(request_id=self.new_request_id(), prompt=prompt, messages=messages,
                       add_special_tokens=add_special_tokens, return_token_strs=return_token_strs, **chat)
        out = await self.ask(msg)
        assert isinstance(out, Tokenized)
        return out

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of token ids (special tokens included); an id outside the vocabulary is
        a NoriaError naming `tokens`."""
        out = await self.ask(Detokenize(request_id=self.new_request_id(), tokens=list(tokens)))
        assert isinstance(out, Detokenized)
        return out.prompt

    async def ask(self, msg: Tokenize | Detokenize) -> Tokenized | Detokenized:
        """Send a `tokenize` or `detokenize` (one answer each) and wait for its answer; raises
        NoriaError on an error reply, a timeout or a lost engine."""
        conn = self._conn
        loop = conn.start()
        inbox = conn.open_inbox(msg.request_id)
        try:
            _send_new(conn, msg)
            out = await inbox.get(loop, self.timeout)
        finally:
            conn.close_inbox(msg.request_id, inbox)
        if out is None:
            raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for {msg.request_id} within "
                             f"{self.timeout}s")
        if isinstance(out, Error):
            raise NoriaError(out.code, out.message, param=out.param)
        if not isinstance(out, Tokenized | Detokenized):
            raise NoriaError(ErrorCode.INTERNAL, f"unexpected answer to {msg.request_id}: {type(out).__name__}")
        return out

    async def embed_request(self, msg: Embed) -> Embedding:
        """Send a ready-made `embed`; its `embedding` (vector and usage). Raises NoriaError on an
        error reply (e.g. a server that does not run --runner pooling), a timeout or a lost
        engine. Cancelled, it aborts the request upstream."""
        conn = self._conn
        loop = conn.start()
        rid = msg.request_id
        inbox = conn.open_inbox(rid)
        finished = False
        try:
            try:
                _send_new(conn, msg)
            except NoriaError:
                finished = True  # nothing was sent: nothing to abort
                raise
            out = await inbox.get(loop, self.timeout)
            if out is None:
                raise NoriaError(ErrorCode.TIMEOUT, f"no answer from {self.address} for request {rid} within {self.timeout}s")
            finished = True
            if isinstance(out, Error):
                raise NoriaError(out.code, out.message, param=out.param)
            if not isinstance(out, Embedding):  # a `done`: this client aborted it
                raise NoriaError(ErrorCode.INVALID_REQUEST, f"request {rid} ended without an embedding: it was aborted")
            return out
        finally:
            conn.close_inbox(rid, inbox)
            if not finished and not conn.down:
                conn.send(Abort(request_id=rid))

    async def embed(
        self,
        inputs: Prompt | list[Prompt],
        *,
        dimensions: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[list[float]]:
        """One embedding per input (a text, token ids, or a list of either), in input order,
        from a server started with `--runner pooling`. The inputs run as one request each, side by
        side; the first error is raised and the others are aborted."""
        msgs = [make_embed(self.new_request_id(), p, dimensions=dimensions, priority=priority, cache_salt=cache_salt)
                for p in prompt_list(inputs)]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.embed_request(m)) for m in msgs]
        except ExceptionGroup as e:
            raise e.exceptions[0] from None
        return [t.result().embedding for t in tasks]

    async def abort(self, request_id: str) -> None:
        """Abort a request of this client; it ends with a `done` whose finish_reason is "abort"."""
        self._conn.start()
        self._conn.send(Abort(request_id=request_id))

    def close(self) -> None:
        """Fail what is in flight and release the socket. Call it on the client's loop."""
        self._conn.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _send_new(conn: Connection, msg: Generate | Embed | Tokenize | Detokenize) -> None:
    """Send a request's first message; a value msgpack cannot carry (nothing was sent) is a
    NoriaError for that request."""
    try:
        conn.send(msg)
    except (OverflowError, RecursionError) as e:
        raise NoriaError(ErrorCode.INVALID_REQUEST, f"the request cannot be encoded: {e}") from None
