"""How `noria serve` runs the bridge: a child process that is a ZMQ client like any other."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from noria.frontend.bridge.main import API_KEY_ENV

log = logging.getLogger("noria.bridge")


def engine_address(host: str, zmq_port: int) -> str:
    """Where a local bridge reaches a ROUTER bound on `host` (a wildcard is reached on loopback)."""
    if host in ("0.0.0.0", "*", "::", ""):
        host = "127.0.0.1"
    return f"tcp://{host}:{zmq_port}"


class BridgeProcess:
    def __init__(self, engine: str, host: str, port: int, api_key: str | None) -> None:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if api_key:
            env[API_KEY_ENV] = api_key
        self.stopping = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", engine,
             "--host", host, "--port", str(port), "--parent-pid", str(os.getpid())],
            env=env,
        )

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
