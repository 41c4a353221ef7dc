"""Helpers for the worker-link tests: run `noria worker`, find a server's worker ranks,
stream many requests at once, and poll the engine's stats with deadlines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from noria import AsyncClient, Client, SamplingParams
from noria.protocol.client import Delta, Done, Stats
from tests.procs import children_of

NORIA = [sys.executable, "-m", "noria.cli"]


def health(http: str) -> tuple[int, dict]:
    """GET /health: (status, body); (0, {}) while the bridge does not answer."""
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def worker_cmd(connect: str, *flags: str) -> list[str]:
    return [*NORIA, "worker", "--connect", connect, *flags]


def start_worker(connect: str, *flags: str, **kw: object) -> subprocess.Popen[str]:
    """`noria worker --connect ADDR FLAGS` with its output captured as text."""
    return subprocess.Popen(worker_cmd(connect, *flags), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)  # type: ignore[call-overload]


def local_workers(server_pid: int) -> list[int]:
    return [k for k in children_of(server_pid) if b"noria.worker" in Path(f"/proc/{k}/cmdline").read_bytes()]


def wait_for(what: str, ok: Callable[[], object], timeout: float) -> object:
    """Poll `ok()` until it is truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)  # poll interval; the deadline bounds the wait


def stats(address: str) -> Stats:
    with Client(address, timeout=60) as c:
        return c.stats()


def wait_stats(address: str, ok: Callable[[Stats], bool], what: str, timeout: float = 60.0) -> Stats:
    """Ask for stats until `ok` holds (published stats lag a query behind)."""
    last: list[Stats] = []

    def check() -> bool:
        last[:] = [stats(address)]
        return ok(last[0])

    try:
        wait_for(what, check, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; last stats: {last[0] if last else None}") from None
    return last[0]


@dataclass
class Streamed:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


async def stream_all(address: str, prompts: list[str], params: SamplingParams,
                     progress: list[int] | None = None) -> list[Streamed]:
    """Every prompt as its own streaming request, all at once; `progress[0]` counts deltas."""
    async with AsyncClient(address, timeout=120) as client:

        async def one(prompt: str) -> Streamed:
            out = Streamed()
            async for msg in client.stream(prompt, params):
                if isinstance(msg, Delta):
                    out.token_ids += msg.token_ids
                    out.text += msg.text
                    if progress is not None:
                        progress[0] += 1
                elif isinstance(msg, Done):
                    out.finish_reason = msg.finish_reason
            return out

        return list(await asyncio.gather(*(one(p) for p in prompts)))
