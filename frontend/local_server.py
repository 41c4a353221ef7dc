"""`noria serve` as a child process on free local ports, for benchmarks, tests and scripts.

The server is ready when its ZMQ API answers `hello` (and, if asked, its bridge
answers GET /health); a server that exits while starting is reported at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from typing import IO

from noria.protocol.sockets import free_tcp_port


def wait_ready(address: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until the engine at `address` answers `hello`, or fail if `proc` exits first."""
    from noria.frontend.client import Client
    from noria.protocol.errors import NoriaError

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
    raise TimeoutError(f"noria serve did not answer hello on {address} within {timeout:.0f}s")


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until the bridge at `url` answers GET /health with 200, or fail if `proc` exits first."""
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
        time.sleep(0.1)  # poll interval, not synchronisation: the deadline bounds the wait
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f}s")


class LocalServer:
    """`noria serve FLAGS` on free ZMQ and HTTP ports (unless FLAGS name them).

    `cmd` replaces the `noria` command (default: this interpreter's `-m noria.frontend.cli`).
    """

    def __init__(
        self, *flags: str, cmd: list[str] | None = None, cwd: str | None = None,
        env: Mapping[str, str] | None = None, zmq_port: int | None = None, log: IO[bytes] | None = None,
    ) -> None:
        zmq_port = zmq_port or free_tcp_port()
        extra = [] if "--port" in flags else ["--port", str(free_tcp_port())]
        argv = [*(cmd or [sys.executable, "-m", "noria.frontend.cli"]), "serve", "--zmq-port", str(zmq_port), *extra, *flags]
        self.address = f"tcp://127.0.0.1:{zmq_port}"
        self.http = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        # `log`: a file for the server's stdout and stderr (a fuzzer reads it for tracebacks).
        self.proc = subprocess.Popen(argv, cwd=cwd, env=None if env is None else dict(env), stdout=log,
                                     stderr=None if log is None else subprocess.STDOUT)

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
