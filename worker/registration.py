"""What a worker rank tells the scheduler about itself when it registers."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from noria.protocol.model_identity import ModelIdentity
from noria.protocol.worker_link import WORKER_PROTOCOL_VERSION, Register


def hello(rank: int, device: str | None, model: ModelIdentity | None, connect: str) -> Register:
    name, capacity = describe_device(device or "auto")
    dist = rendezvous_address(connect) if rank == 0 else None
    return Register(WORKER_PROTOCOL_VERSION, rank, name, socket.gethostname(), os.getpid(), capacity, model, dist)


def describe_device(device: str) -> tuple[str, int]:
    """The device this rank will use and the bytes it could give a KV cache (free device
    memory on a GPU, available memory on a CPU); informational, for the scheduler's log."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return f"cuda ({torch.cuda.get_device_name()})", int(free)
        if device == "cuda":
            return "cuda (not available: loading will fail)", 0
    return "cpu", _mem_available()


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rendezvous_address(connect: str) -> str:
    """HOST:PORT where this rank can host the tensor-parallel rendezvous: HOST is this
    host's address on the route to the scheduler (the other ranks reach the scheduler,
    so they can reach this address too), PORT one that is free now."""
    parts = urlsplit(connect)
    host = "127.0.0.1"
    if parts.scheme == "tcp" and parts.hostname and parts.port:
        # Connecting a UDP socket sends nothing; it only picks the route and its source address.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((parts.hostname, parts.port))
                host = s.getsockname()[0]
            except OSError:
                pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"
