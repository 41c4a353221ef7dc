"""Starts the scheduler and the local worker ranks on this host and watches them.

Children are started as `python -m noria.scheduler` / `python -m noria.worker` (the same
code a multi-host deployment runs as `noria worker`), so the frontend never imports engine
code. Local ranks register on the scheduler's worker link like remote ones; their config
comes in the scheduler's Welcome.

While the engine starts, any child that exits is reported by name (start-up fails). Once
it is up, only the scheduler's exit is an engine death: a worker rank that exits is
restarted, at most `max_worker_restarts` times per rank within `RESTART_WINDOW` seconds;
past that it stays down, and the scheduler fails waiting requests after `worker_wait`.
A dead scheduler is the frontend's to handle (frontend/supervisor.py): `restart_engine`
starts a new scheduler with new local ranks.

Children run in a session of their own, so a signal meant for `noria serve` as a whole (Ctrl-C
in a terminal, `timeout`, `kill -- -PGID`) reaches the server alone, which drains and then stops
them in order. Once the server drains (`hold_restarts`), a rank that exits stays down: a
service manager that signals every process of the service at once (systemd's default
KillMode=control-group) is stopping the server, not asking for new ranks.
"""

from __future__ import annotations

import collections
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

import msgspec

from noria.frontend.api_key import child_env
from noria.protocol import logs
from noria.protocol.config import RESTART_WINDOW, EngineAddresses, EngineConfig, WorkerLinkConfig

log = logging.getLogger("noria.launcher")

WATCH_INTERVAL = 0.1
# A rank stopped by SIGTERM/SIGINT may have been signalled with the server (systemd signals every
# process of a service at once): the server's own handler gets this long to begin the drain
# before the rank is restarted.
SIGNAL_GRACE = 0.5
_STOP_CODES = (-signal.SIGTERM, -signal.SIGINT)


def local_addresses(folder: str, worker_listen: str | None) -> EngineAddresses:
    """ipc:// addresses inside `folder`, a private directory removed at shutdown; the
    worker link is `worker_listen` when remote workers are to reach it."""
    return EngineAddresses(
        requests=f"ipc://{folder}/requests",
        outputs=f"ipc://{folder}/outputs",
        workers=worker_listen or f"ipc://{folder}/workers",
    )


def connect_address(bound: str) -> str:
    """Where a local rank connects to a link bound at `bound` (a wildcard host is not an address)."""
    parts = urlsplit(bound)
    if parts.scheme == "tcp" and parts.hostname in ("*", "0.0.0.0", "::"):
        return f"tcp://127.0.0.1:{parts.port}"
    return bound


class EngineProcesses:
    def __init__(self, config: EngineConfig, link: WorkerLinkConfig | None = None) -> None:
        link = link or WorkerLinkConfig()
        self.link = link
        self.folder = tempfile.mkdtemp(prefix="noria-")
        self.addrs = addrs = local_addresses(self.folder, link.worker_listen)
        self.num_local = link.local_workers(config.tensor_parallel_size)
        self.link_json = msgspec.json.encode(msgspec.structs.replace(link, num_local_workers=self.num_local)).decode()
        self.env = child_env()  # the engine never needs the API key
        self.lock = threading.Lock()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.scheduler_argv = [sys.executable, "-m", "noria.scheduler", "--config", msgspec.json.encode(config).decode(),
                               "--addresses", msgspec.json.encode(addrs).decode(), "--link", self.link_json,
                               *logs.child_args()]
        self.worker_argv = [sys.executable, "-m", "noria.worker", "--connect", connect_address(addrs.workers),
                            "--model", config.model, "--device", config.device, *logs.child_args()]
        if link.curve_keys:
            self.worker_argv += ["--curve-keys", link.curve_keys]
        self._start_all()
        self.restarts: dict[int, collections.deque[float]] = {r: collections.deque() for r in range(self.num_local)}
        self.given_up: set[int] = set()
        self.stopping = threading.Event()
        self.draining = threading.Event()  # set by the server's drain: no rank is restarted from then on
        self.watcher: threading.Thread | None = None

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        # A session of its own: see the module docstring. No stdin: nothing here reads it.
        return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_all(self) -> None:
        self.procs["scheduler"] = self._spawn(self.scheduler_argv)
        for rank in range(self.num_local):
            self.procs[_worker_name(rank)] = self._start_worker(rank)

    def restart_engine(self) -> None:
        """A new scheduler and new local ranks, on the same addresses (remote ranks find the
        new scheduler by themselves: theirs went silent, so they register again). The old
        ranks are killed: they hold only the dead scheduler's KV and requests."""
        with self.lock:  # the watcher restarts no rank meanwhile
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            for p in self.procs.values():
                p.wait()
            self._start_all()
            self.given_up.clear()
            for recent in self.restarts.values():
                recent.clear()

    def _start_worker(self, rank: int) -> subprocess.Popen[bytes]:
        return self._spawn([*self.worker_argv, "--rank", str(rank)])

    def startup_failure(self) -> str | None:
        """While the engine starts: a sentence naming the first child that has exited, or None."""
        with self.lock:
            for name, p in self.procs.items():
                rc = p.poll()
                if rc is not None:
                    return f"the {name} process exited with code {rc}"
        return None

    def dead(self) -> str | None:
        """Once the engine is up: why it is dead (its scheduler exited), or None. Worker
        ranks that exit are restarted by `watch`, not reported here."""
        with self.lock:
            rc = self.procs["scheduler"].poll()
        return None if rc is None else f"the scheduler process exited with code {rc}"

    def watch(self) -> None:
        """From now on, restart local ranks that exit (the engine is up)."""
        if self.num_local and self.watcher is None:
            self.watcher = threading.Thread(target=self._watch, name="worker-watch", daemon=True)
            self.watcher.start()

    def hold_restarts(self) -> None:
        """The server drains: a rank that exits from now on is not restarted. Lock-free: it is
        called from a signal handler, which may interrupt a holder of the lock."""
        self.draining.set()

    def scheduler_signalled(self) -> bool:
        """The scheduler was stopped by SIGTERM/SIGINT (maybe with the server: see SIGNAL_GRACE)."""
        with self.lock:
            return self.procs["scheduler"].poll() in _STOP_CODES

    def worker_down(self) -> str | None:
        """While draining: why the local ranks cannot serve (one has exited and stays down), or None."""
        with self.lock:
            for rank in sorted(self.given_up):
                rc = self.procs[_worker_name(rank)].poll()
                if rc is not None:
                    return f"{_worker_name(rank)} exited with code {rc}"
        return None

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL):
            for rank in range(self.num_local):
                with self.lock:
                    proc = self.procs[_worker_name(rank)]
                    rc = None if rank in self.given_up else proc.poll()
                if rc is None:
                    continue
                if rc in _STOP_CODES:
                    self.draining.wait(SIGNAL_GRACE)
                with self.lock:
                    if self.stopping.is_set() or self.procs[_worker_name(rank)] is not proc:
                        continue  # shutting down, or `restart_engine` replaced it meanwhile
                    if self.draining.is_set():
                        self.given_up.add(rank)
                        log.log(logging.INFO if rc == 0 else logging.WARNING,
                                "worker rank %d exited with code %d while the server drains", rank, rc)
                    else:
                        self._restart(rank, rc)

    def _restart(self, rank: int, rc: int) -> None:
        """Called with the lock held."""
        now = time.monotonic()
        recent = self.restarts[rank]
        while recent and now - recent[0] > RESTART_WINDOW:
            recent.popleft()
        if len(recent) >= self.link.max_worker_restarts:
            self.given_up.add(rank)
            log.error("worker rank %d exited with code %d; not restarting it: %d restart(s) in the last %gs "
                      "(--max-worker-restarts %d)", rank, rc, len(recent), RESTART_WINDOW,
                      self.link.max_worker_restarts)
            return
        recent.append(now)
        log.warning("worker rank %d exited with code %d; restarting it", rank, rc)
        self.procs[_worker_name(rank)] = self._start_worker(rank)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        if self.watcher is not None:
            self.watcher.join()
        with self.lock:
            procs = list(self.procs.values())
            if self.procs["scheduler"].poll() is not None:
                timeout = 0.0  # no scheduler to tell the workers to stop: they are terminated now
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _worker_name(rank: int) -> str:
    return f"worker rank {rank}"
