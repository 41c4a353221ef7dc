"""`noria bridge`: run the HTTP/websocket bridge on uvloop until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
import typing

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from noria.frontend.bridge.app import make_app
from noria.frontend.bridge.limits import BridgeLimits
from noria.frontend.bridge.metrics import BridgeMetrics
from noria.frontend.bridge.process import EXIT_CANNOT_LISTEN
from noria.frontend.bridge.state import GATEWAY, METRICS

log = logging.getLogger("noria.bridge")


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every malformed HTTP request (already answered 400) as an error with a
    traceback; anyone can send garbage, so those go to the debug level and nowhere else."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg, record.args, record.exc_info = f"{record.getMessage()}: {exc!s}".replace("\n", " "), (), None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


# aiohttp's limits on a request head, stated here because docs/protocol.md promises them.
MAX_LINE = 8190  # bytes of the request line
MAX_FIELD = 8190  # bytes of one header
MAX_HEADERS = 128
NO_TIMEOUT = 365 * 24 * 3600.0


class _Refused(asyncio.Protocol):
    """A connection over --max-connections: answered 503 at once and closed. What the client
    sent meanwhile is read and dropped until it closes (closing on unread data would reset
    the connection, and the answer with it), for LINGER seconds at most."""

    LINGER = 2.0
    RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")

    def __init__(self, body: bytes, lingering: set[asyncio.Transport]) -> None:
        self.body = body
        self.lingering = lingering
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = typing.cast(asyncio.Transport, transport)  # uvloop's are not asyncio's subclasses
        transport.write(self.RESPONSE % (len(self.body), self.body))
        if len(self.lingering) >= _MAX_LINGERING:
            transport.abort()
            return
        self.transport = transport
        self.lingering.add(transport)
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            transport.write_eof()
        asyncio.get_running_loop().call_later(self.LINGER, transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lingering.discard(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client is done: close


_MAX_LINGERING = 1024  # refused connections waiting for their client to close; more are reset at once


class _ConnectionCap:
    """The listening socket's protocol factory: aiohttp's handler while fewer than `cap`
    connections are open (HTTP requests, SSE streams and websockets alike), else `_Refused`."""

    def __init__(self, server: web.Server, cap: int, metrics: BridgeMetrics) -> None:
        from noria.frontend.bridge.errors import error_body

        self.server, self.cap, self.metrics = server, cap, metrics
        self.body = error_body(503, f"the server has {cap} connections open, its limit (--max-connections); retry "
                               "later", "too_many_connections")
        self.lingering: set[asyncio.Transport] = set()

    def __call__(self) -> asyncio.BaseProtocol:
        if self.cap and len(self.server.connections) >= self.cap:
            self.metrics.refused.inc()
            return _Refused(self.body, self.lingering)
        return self.server()


def _raise_fd_limit(connections: int) -> None:
    """Room for `connections` sockets besides the process's own files, where the hard limit allows."""
    want = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft < want:
        log.warning("open files are limited to %d: fewer than --max-connections %d can be served", soft, connections)


async def serve(engine: str, host: str, port: int, api_key: str | None, *, handle_sigint: bool = True,
                limits: BridgeLimits | None = None, curve_keys: str | None = None,
                return_tokens_as_token_ids: bool = False) -> int:
    limits = limits or BridgeLimits()
    app = make_app(engine, api_key, curve_keys=curve_keys, limits=limits,
                   return_tokens_as_token_ids=return_tokens_as_token_ids)
    logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())
    if limits.max_connections:
        _raise_fd_limit(limits.max_connections)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts upstream.
    # keepalive_timeout: aiohttp closes a connection still waiting for a whole request head
    # that long after it opened or after its previous response: the header timeout.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=limits.header_timeout or NO_TIMEOUT, max_line_size=MAX_LINE,
                           max_field_size=MAX_FIELD, max_headers=MAX_HEADERS)
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    try:
        # Not web.TCPSite: the connection cap needs the protocol factory.
        listener = await loop.create_server(_ConnectionCap(runner.server, limits.max_connections, app[METRICS]),
                                            host, port, reuse_address=True)
    except OSError as e:
        print(f"noria bridge: cannot listen on {host}:{port}: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        # Under `noria serve` a code of its own: a taken port is not worth a restart.
        return 1 if handle_sigint else EXIT_CANNOT_LISTEN
    print(f"noria bridge: http://{host}:{port} (ws /v1/stream, OpenAI /v1, /metrics) -> {engine}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if handle_sigint:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        await stop.wait()
        await _finish_streams(app)
    finally:
        listener.close()
        await runner.cleanup()
    return 0


# `noria serve` stops the bridge once the engine has sent every final message; those may still
# be on their way through this process to the clients' sockets, which `cleanup` closes.
FLUSH_GRACE = 3.0


async def _finish_streams(app: web.Application) -> None:
    gateway = app.get(GATEWAY)
    if gateway is not None and gateway.active:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gateway.idle.wait(), FLUSH_GRACE)


def run(engine: str, host: str, port: int, api_key: str | None, *, parent_pid: int | None = None,
        limits: BridgeLimits | None = None, curve_keys: str | None = None,
        return_tokens_as_token_ids: bool = False) -> int:
    if parent_pid:
        # Started by `noria serve`: Ctrl-C is the parent's to handle (it sends SIGTERM
        # in order), and a parent that dies takes the bridge with it. The pid is
        # checked because the parent may already be gone by the time we get here.
        if os.getppid() != parent_pid:
            return 3
        from noria.protocol.lifecycle import become_child

        become_child()
    return uvloop.run(serve(engine, host, port, api_key, handle_sigint=not parent_pid, limits=limits,
                            curve_keys=curve_keys, return_tokens_as_token_ids=return_tokens_as_token_ids))
