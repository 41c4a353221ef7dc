"""How `noria serve` runs the bridge: a child process that is a ZMQ client like any other."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from noria.frontend.api_key import child_env
from noria.protocol.lifecycle import stop_child

log = logging.getLogger("noria.bridge")


def engine_address(host: str, zmq_port: int) -> str:
    """Where a local bridge reaches a ROUTER bound on `host` (a wildcard is reached on loopback)."""
    if host in ("0.0.0.0", "*", "::", ""):
        host = "127.0.0.1"
    return f"tcp://{host}:{zmq_port}"


class BridgeProcess:
    def __init__(self, engine: str, host: str, port: int, api_key: str | None, extra: Sequence[str] = ()) -> None:
        argv = [sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", engine,
                "--host", host, "--port", str(port), "--parent-pid", str(os.getpid()), *extra]
        if api_key:
            argv += ["--api-key-file", "-"]  # the key comes through a pipe: see frontend/api_key.py
        self.stopping = False
        self.proc = subprocess.Popen(argv, env=child_env(), stdin=subprocess.PIPE if api_key else subprocess.DEVNULL)
        if api_key:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(api_key.encode() + b"\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # the bridge is already gone; `watch` reports its exit

    def watch(self, on_unexpected_exit: Callable[[int], None]) -> None:
        """Call `on_unexpected_exit(returncode)` (from a thread) if the bridge dies on its own."""

        def wait() -> None:
            rc = self.proc.wait()
            if not self.stopping:
                log.error("the bridge process exited with code %d", rc)
                on_unexpected_exit(rc)

        threading.Thread(target=wait, name="bridge-watch", daemon=True).start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        stop_child(self.proc, signal.SIGTERM, timeout)
