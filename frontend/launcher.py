"""Starts the scheduler and worker processes on this host and watches them.

Children are started as `python -m noria.scheduler` / `python -m noria.worker` (the same
commands a multi-host deployment runs by hand), so the frontend never imports
engine code. A child that exits is reported by name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time

import msgspec

from noria.frontend.api_key import child_env
from noria.protocol.config import EngineAddresses, EngineConfig


def local_addresses(tensor_parallel_size: int, folder: str) -> EngineAddresses:
    """ipc:// addresses inside `folder`, a private directory removed at shutdown."""
    return EngineAddresses(
        requests=f"ipc://{folder}/requests",
        outputs=f"ipc://{folder}/outputs",
        plans=[f"ipc://{folder}/plans{r}" for r in range(tensor_parallel_size)],
        results=f"ipc://{folder}/results",
    )


def free_tcp_address() -> str:
    """tcp://127.0.0.1:PORT on a port free right now: the tensor-parallel
    ranks' torch.distributed rendezvous, which rank 0 binds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class EngineProcesses:
    def __init__(self, config: EngineConfig) -> None:
        self.folder = tempfile.mkdtemp(prefix="noria-")
        self.addrs = addrs = local_addresses(config.tensor_parallel_size, self.folder)
        common = [
            "--config", msgspec.json.encode(config).decode(),
            "--addresses", msgspec.json.encode(addrs).decode(),
        ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        env = child_env()  # the engine never needs the API key
        self.procs["scheduler"] = subprocess.Popen([sys.executable, "-m", "noria.scheduler", *common], env=env)
        dist = ["--dist-init-method", free_tcp_address()] if config.tensor_parallel_size > 1 else []
        for rank in range(config.tensor_parallel_size):
            self.procs[f"worker rank {rank}"] = subprocess.Popen(
                [sys.executable, "-m", "noria.worker", *common, "--rank", str(rank), *dist], env=env
            )

    def dead(self) -> str | None:
        """A sentence naming the first child that has exited, or None."""
        for name, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                return f"the {name} process exited with code {rc}"
        return None

    def shutdown(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
