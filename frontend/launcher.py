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
"""

from __future__ import annotations

import collections
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

import msgspec

from noria.frontend.api_key import child_env
from noria.protocol.config import RESTART_WINDOW, EngineAddresses, EngineConfig, WorkerLinkConfig

log = logging.getLogger("noria.launcher")

WATCH_INTERVAL = 0.1


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
                               "--addresses", msgspec.json.encode(addrs).decode(), "--link", self.link_json]
        self.worker_argv = [sys.executable, "-m", "noria.worker", "--connect", connect_address(addrs.workers),
                            "--model", config.model, "--device", config.device]
        if link.curve_keys:
            self.worker_argv += ["--curve-keys", link.curve_keys]
        self._start_all()
        self.restarts: dict[int, collections.deque[float]] = {r: collections.deque() for r in range(self.num_local)}
        self.given_up: set[int] = set()
        self.stopping = threading.Event()
        self.watcher: threading.Thread | None = None

    def _start_all(self) -> None:
        self.procs["scheduler"] = subprocess.Popen(self.scheduler_argv, env=self.env)
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
        return subprocess.Popen([*self.worker_argv, "--rank", str(rank)], env=self.env)

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

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL):
            for rank in range(self.num_local):
                with self.lock:
                    if rank in self.given_up:
                        continue
                    rc = self.procs[_worker_name(rank)].poll()
                    if rc is not None and not self.stopping.is_set():
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
