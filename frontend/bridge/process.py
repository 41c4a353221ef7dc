"""How `noria serve` runs the bridge: a child process that is a ZMQ client like any other."""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from noria.frontend.api_key import child_env
from noria.protocol.config import RESTART_WINDOW
from noria.protocol.lifecycle import stop_child

log = logging.getLogger("noria.bridge")

MAX_RESTARTS = 5  # bridge restarts within RESTART_WINDOW seconds before `noria serve` gives up
EXIT_CANNOT_LISTEN = 4  # the exit code of a bridge started by `noria serve` whose port is taken


def engine_address(host: str, zmq_port: int) -> str:
    """Where a local bridge reaches a ROUTER bound on `host` (a wildcard is reached on loopback)."""
    if host in ("0.0.0.0", "*", "::", ""):
        host = "127.0.0.1"
    return f"tcp://{host}:{zmq_port}"


class BridgeProcess:
    """The bridge child of `noria serve`. One that dies on its own is started again (its HTTP
    and websocket clients saw their connections close; the frontend aborts their requests
    when a send to the old bridge's ZMQ connection fails), at most `MAX_RESTARTS` times
    within `RESTART_WINDOW` seconds; one that cannot listen on its port is not."""

    def __init__(self, engine: str, host: str, port: int, api_key: str | None, extra: Sequence[str] = ()) -> None:
        self.argv = [sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", engine,
                     "--host", host, "--port", str(port), "--parent-pid", str(os.getpid()), *extra]
        if api_key:
            self.argv += ["--api-key-file", "-"]  # the key comes through a pipe: see frontend/api_key.py
        self.api_key = api_key
        self.lock = threading.Lock()
        self.stopping = False
        self.draining = threading.Event()  # `noria serve` drains: a bridge that exits now is not restarted
        self.restarts = 0
        self.recent: collections.deque[float] = collections.deque()
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        key = self.api_key
        # A session of its own, as the engine's children (frontend/launcher.py): a signal for the
        # whole of `noria serve` reaches the server, which stops the bridge last.
        proc = subprocess.Popen(self.argv, env=child_env(), stdin=subprocess.PIPE if key else subprocess.DEVNULL,
                                start_new_session=True)
        if key:
            assert proc.stdin is not None
            try:
                proc.stdin.write(key.encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the bridge is already gone; `watch` reports its exit
        return proc

    def watch(self, on_unexpected_exit: Callable[[int], None]) -> None:
        """Restart the bridge when it dies on its own; call `on_unexpected_exit(returncode)`
        (from a thread) when it dies and is not restarted."""

        def wait() -> None:
            while True:
                rc = self.proc.wait()
                with self.lock:
                    if self.stopping:
                        return
                    if self.draining.is_set():
                        # Its clients' requests are aborted by the frontend; the server exits 0 as planned.
                        log.warning("the bridge process exited with code %d while the server drains", rc)
                        return
                    if rc != EXIT_CANNOT_LISTEN and self._may_restart():
                        log.error("the bridge process exited with code %d; restarting it", rc)
                        self.restarts += 1
                        self.proc = self._spawn()
                        continue
                log.error("the bridge process exited with code %d", rc)
                on_unexpected_exit(rc)
                return

        threading.Thread(target=wait, name="bridge-watch", daemon=True).start()

    def hold_restarts(self) -> None:
        """`noria serve` drains: from now on a bridge that exits stays down (lock-free: called
        from a signal handler)."""
        self.draining.set()

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self.recent and now - self.recent[0] > RESTART_WINDOW:
            self.recent.popleft()
        if len(self.recent) >= MAX_RESTARTS:
            return False
        self.recent.append(now)
        return True

    def stop(self, timeout: float = 10.0) -> None:  # the bridge may take FLUSH_GRACE + its 2 s shutdown
        with self.lock:
            self.stopping = True
            proc = self.proc
        stop_child(proc, signal.SIGTERM, timeout)
