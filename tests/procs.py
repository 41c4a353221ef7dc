"""Helpers to run `noria serve` as a real process and to check it leaves nothing behind."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import IO, Any, NamedTuple

from noria.frontend.local_server import LocalServer, child_pids, wait_http, wait_ready

__all__ = ["alive", "children_of", "engine_idle", "scrape_metrics", "serve", "serve_http", "wait_gone",
           "wait_http", "wait_metrics", "wait_ready"]


def children_of(pid: int) -> list[int]:
    return child_pids(pid)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Served(NamedTuple):
    address: str  # the ZMQ client API
    http: str  # the bridge: http://127.0.0.1:PORT
    proc: subprocess.Popen


def wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    """Poll until none of `pids` is alive or the deadline passes; the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def serve(*args: str, cmd: list[str] | None = None, cwd: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `noria serve` on a free port; on exit Ctrl-C it and check it cleaned up."""
    with serve_http(*args, cmd=cmd, cwd=cwd, wait_bridge=False) as s:
        yield s.address, s.proc


@contextlib.contextmanager
def serve_http(
    *args: str, cmd: list[str] | None = None, cwd: str | None = None, zmq_port: int | None = None,
    wait_bridge: bool = True, env: dict[str, str] | None = None, stderr: IO[Any] | None = None,
    wait_zmq: bool = True,
) -> Iterator[Served]:
    """`noria serve` on free ZMQ and HTTP ports (unless `args` name them), ready on both;
    on exit it is Ctrl-C'd and must exit 0 leaving no child process behind."""
    server = LocalServer(*args, cmd=cmd, cwd=cwd, zmq_port=zmq_port, env=env, stderr=stderr)
    try:
        server.wait(http=wait_bridge, zmq=wait_zmq)
        kids = children_of(server.proc.pid)
        yield Served(server.address, server.http, server.proc)
    finally:
        server.stop()
    assert server.proc.returncode == 0, f"noria serve exited with {server.proc.returncode}"
    leftover = wait_gone(kids)
    assert not leftover, f"orphan processes after shutdown: {leftover}"


def scrape_metrics(http: str) -> dict[str, float]:
    """GET /metrics parsed with prometheus-client's own text parser: {'name{k="v"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_metrics(http: str, ok, timeout: float = 60.0) -> dict[str, float]:
    """Scrape until `ok(metrics)` holds; returns the last scrape either way (the deadline
    only bounds a hang: a busy machine may take many seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(http)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)  # poll interval; the deadline bounds the wait


def engine_idle(m: dict[str, float]) -> bool:
    return (m["noria_kv_cache_usage_ratio"] == 0 and m["noria_num_requests_running"] == 0
            and m["noria_num_requests_waiting"] == 0 and m["noria_num_open_requests"] == 0)
