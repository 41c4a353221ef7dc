"""ZeroMQ socket helpers shared by every process."""

from __future__ import annotations

import zmq


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
