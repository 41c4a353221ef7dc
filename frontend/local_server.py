"""`noria serve` as a child process on free local ports, for benchmarks, tests and scripts.

The server is ready when its ZMQ API answers `hello` (and, if asked, its bridge
answers GET /health); a server that exits while starting is reported at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from noria.protocol.lifecycle import stop_child
from noria.protocol.sockets import free_tcp_port


def child_pids(pid: int, marker: bytes | None = None) -> list[int]:
    """The processes whose parent is `pid` (and whose command line holds `marker`, if given)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == pid and (marker is None or marker in Path(f"/proc/{entry}/cmdline").read_bytes()):
                out.append(int(entry))
        except OSError:
            continue  # gone while we looked
    return out


def wait_ready(address: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until the engine at `address` answers `hello`, or fail if `proc` exits first."""
    from noria.frontend.client import Client
    from noria.protocol.errors import NoriaError

    def answers() -> bool:
        try:
            with Client(address, timeout=2.0) as c:
                c.hello()
                return True
        except NoriaError:
            return False

    _poll(answers, proc, timeout, f"noria serve did not answer hello on {address}")


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until the bridge at `url` answers GET /health with 200, or fail if `proc` exits first."""
    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    _poll(healthy, proc, timeout, f"{url}/health did not answer 200")


def _poll(check: Callable[[], bool], proc: subprocess.Popen, timeout: float, failure: str) -> None:
    """Call `check` until it holds; fail at once if `proc` exits, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"noria exited early with code {proc.returncode}")
        if check():
            return
        time.sleep(0.1)  # poll interval, not synchronisation: the deadline bounds the wait
    raise TimeoutError(f"{failure} within {timeout:.0f}s")


class LocalServer:
    """`noria serve FLAGS` on free ZMQ and HTTP ports (unless FLAGS name them).

    `cmd` replaces the `noria` command (default: this interpreter's `-m noria.frontend.cli`);
    `stderr` takes the server's log (default: this process's stderr).
    """

    def __init__(
        self, *flags: str, cmd: list[str] | None = None, cwd: str | None = None,
        env: Mapping[str, str] | None = None, zmq_port: int | None = None, stderr: IO[Any] | None = None,
        log: IO[bytes] | None = None, new_session: bool = False,
    ) -> None:
        zmq_port = zmq_port or free_tcp_port()
        extra = [] if "--port" in flags else ["--port", str(free_tcp_port())]
        argv = [*(cmd or [sys.executable, "-m", "noria.frontend.cli"]), "serve", "--zmq-port", str(zmq_port), *extra, *flags]
        self.address = f"tcp://127.0.0.1:{zmq_port}"
        self.http = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        # `log`: a file for the server's stdout and stderr (a fuzzer reads it for tracebacks).
        # `new_session`: the server leads a process group of its own, as under `timeout` or a
        # terminal, so a test can signal the whole group.
        self.proc = subprocess.Popen(argv, cwd=cwd, env=None if env is None else dict(env), stdout=log,
                                     stderr=stderr if log is None else subprocess.STDOUT, start_new_session=new_session)

    def wait(self, timeout: float = 120.0, *, http: bool = False, zmq: bool = True) -> None:
        """Wait until the ZMQ API (and with `http`, the bridge too) answers. `zmq=False` waits
        for the bridge alone (a CURVE-protected API does not answer a plain client)."""
        try:
            if zmq:
                wait_ready(self.address, self.proc, timeout)
            if http:
                wait_http(self.http, self.proc, timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> int:
        """Ctrl-C the server, as a user would; kill it if it is not gone in `timeout` s."""
        return stop_child(self.proc, signal.SIGINT, timeout)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
