"""What a worker rank tells the scheduler about itself when it registers."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from noria.protocol.model_identity import ModelIdentity
from noria.protocol.worker_link import WORKER_PROTOCOL_VERSION, Register
from noria.worker.host import memory_available


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
    return "cpu", memory_available()


def address_towards(connect: str) -> str:
    """This host's address on the route to the scheduler at `connect` (127.0.0.1 for ipc)."""
    parts = urlsplit(connect)
    if parts.scheme == "tcp" and parts.hostname and parts.port:
        # Connecting a UDP socket sends nothing; it only picks the route and its source address.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((parts.hostname, parts.port))
                return str(s.getsockname()[0])
            except OSError:
                pass
    return "127.0.0.1"


def rendezvous_address(connect: str) -> str:
    """HOST:PORT where this rank can host the tensor-parallel rendezvous: HOST is this
    host's address on the route to the scheduler (the other ranks reach the scheduler,
    so they can reach this address too), PORT one that is free now."""
    host = address_towards(connect)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def use_route_for_gloo(connect: str) -> None:
    """Make gloo talk to the other ranks over the interface that reaches the scheduler.

    By default gloo advertises the address its host name resolves to, often a loopback
    one (127.0.1.1), which ranks on other hosts cannot reach. An operator's own
    GLOO_SOCKET_IFNAME wins; so does the default when the scheduler is on this host.
    """
    host = address_towards(connect)
    if "GLOO_SOCKET_IFNAME" in os.environ or host.startswith("127."):
        return
    name = _interface_of(host)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _interface_of(ip: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915  # Linux: an interface's IPv4 address
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == ip:
            return name
    return None
