"""`noria bridge`: run the HTTP/websocket bridge on uvloop until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from noria.frontend.bridge.app import make_app
from noria.frontend.bridge.process import EXIT_CANNOT_LISTEN
from noria.frontend.bridge.state import GATEWAY


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


async def serve(engine: str, host: str, port: int, api_key: str | None, *, handle_sigint: bool = True,
                max_per_client: int | None = None, curve_keys: str | None = None) -> int:
    app = make_app(engine, api_key, max_per_client, curve_keys)
    logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())
    # handler_cancellation: a client that hangs up cancels its handler, which aborts upstream.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as e:
        print(f"noria bridge: cannot listen on {host}:{port}: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        # Under `noria serve` a code of its own: a taken port is not worth a restart.
        return 1 if handle_sigint else EXIT_CANNOT_LISTEN
    print(f"noria bridge: http://{host}:{port} (ws /v1/stream, OpenAI /v1, /metrics) -> {engine}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if handle_sigint:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        await stop.wait()
        await _finish_streams(app)
    finally:
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
        max_per_client: int | None = None, curve_keys: str | None = None) -> int:
    if parent_pid:
        # Started by `noria serve`: Ctrl-C is the parent's to handle (it sends SIGTERM
        # in order), and a parent that dies takes the bridge with it. The pid is
        # checked because the parent may already be gone by the time we get here.
        if os.getppid() != parent_pid:
            return 3
        from noria.protocol.lifecycle import become_child

        become_child()
    return uvloop.run(serve(engine, host, port, api_key, handle_sigint=not parent_pid, max_per_client=max_per_client,
                            curve_keys=curve_keys))
