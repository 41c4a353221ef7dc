"""Helpers to run `noria serve` as a real process and to check it leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import NamedTuple

from noria.protocol.sockets import free_tcp_port


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_ready(address: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    from noria import Client, NoriaError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"noria serve exited early with code {proc.returncode}")
        try:
            with Client(address, timeout=2.0) as c:
                c.hello()
                return
        except NoriaError:
            continue
    raise TimeoutError("noria serve did not answer hello")


class Served(NamedTuple):
    address: str  # the ZMQ client API
    http: str  # the bridge: http://127.0.0.1:PORT
    proc: subprocess.Popen


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until the bridge answers GET /health with 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"noria exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health did not answer 200")


@contextlib.contextmanager
def serve(*args: str, cmd: list[str] | None = None, cwd: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `noria serve` on a free port; on exit Ctrl-C it and check it cleaned up."""
    with serve_http(*args, cmd=cmd, cwd=cwd, wait_bridge=False) as s:
        yield s.address, s.proc


@contextlib.contextmanager
def serve_http(
    *args: str, cmd: list[str] | None = None, cwd: str | None = None, zmq_port: int | None = None,
    wait_bridge: bool = True,
) -> Iterator[Served]:
    """`noria serve` on free ZMQ and HTTP ports (unless `args` name them), ready on both."""
    port = zmq_port or free_tcp_port()
    extra = [] if "--port" in args else ["--port", str(free_tcp_port())]
    base = cmd or [sys.executable, "-m", "noria.frontend.cli"]
    argv = [*base, "serve", "--zmq-port", str(port), *extra, *args]
    http_port = argv[argv.index("--port") + 1]
    proc = subprocess.Popen(argv, cwd=cwd)
    address = f"tcp://127.0.0.1:{port}"
    http = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(address, proc)
        if wait_bridge:
            wait_http(http, proc)
        kids = children_of(proc.pid)
        yield Served(address, http, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
    assert proc.returncode == 0, f"noria serve exited with {proc.returncode}"
    time.sleep(0.5)
    leftover = [k for k in kids if alive(k)]
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


def wait_metrics(http: str, ok, timeout: float = 15.0) -> dict[str, float]:
    """Scrape until `ok(metrics)` holds; returns the last scrape either way."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(http)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def engine_idle(m: dict[str, float]) -> bool:
    return (m["noria_kv_cache_usage_ratio"] == 0 and m["noria_num_requests_running"] == 0
            and m["noria_num_requests_waiting"] == 0 and m["noria_num_open_requests"] == 0)
