"""ZeroMQ socket helpers shared by every process."""

from __future__ import annotations

import os
import tempfile
import uuid

import zmq


def ipc_address(tag: str) -> str:
    """A fresh ipc:// address in the temp dir (removed by zmq when the binder closes)."""
    path = os.path.join(tempfile.gettempdir(), f"noria-{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}")
    return f"ipc://{path}"


def make_socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: a slow peer must not make us drop or block on messages;
    # flow is bounded by the scheduler's own budgets.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def free_tcp_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
