"""Helpers to run `noria serve` as a real process and to check it leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from protocol.sockets import free_tcp_port


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


@contextlib.contextmanager
def serve(*args: str, cmd: list[str] | None = None, cwd: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `noria serve` on a free port; on exit Ctrl-C it and check it cleaned up."""
    port = free_tcp_port()
    base = cmd or [sys.executable, "-m", "frontend.cli"]
    proc = subprocess.Popen([*base, "serve", "--zmq-port", str(port), *args], cwd=cwd)
    address = f"tcp://127.0.0.1:{port}"
    try:
        wait_ready(address, proc)
        kids = children_of(proc.pid)
        yield address, proc
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
