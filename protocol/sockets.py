"""ZeroMQ socket helpers shared by every process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import zmq

# Client-facing sockets (the frontend's ROUTER, client DEALERs): a peer's queue holds at
# most this many messages, and a bigger frame than this drops the peer's connection.
CLIENT_HWM = 100_000
MAX_CLIENT_MESSAGE = 64 * 2**20  # as the bridge's largest HTTP body
# Engine links (frontend <-> scheduler, scheduler <-> workers): trusted peers, queues bounded
# by the scheduler's budgets and --max-queued-requests rather than by a high-water mark (a
# PUSH at its mark would block or drop a message), but a frame larger than this is a bug or
# an attack and closes the sender's connection. A request is at most MAX_CLIENT_MESSAGE.
MAX_ENGINE_MESSAGE = 256 * 2**20


def make_socket(
    ctx: zmq.Context, kind: int, address: str, *, bind: bool, hwm: int = 0, max_msg_size: int = -1,
    send_hwm: int | None = None, setup: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """Every ZeroMQ socket of noria's processes and client library is made here, so that
    each gets `LINGER` 0 and a deliberate high-water mark and largest frame.

    `hwm` 0 (the default): unbounded queues, so a slow peer never makes us drop or block
    on messages, for links whose flow the scheduler's own budgets bound. `send_hwm`, when
    given, bounds the sending queue apart from the receiving one. `max_msg_size` -1: no
    limit. Sockets that face untrusted peers set both. `setup` runs before the bind or
    connect (CURVE keys and socket monitors must be in place by then)."""
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm if send_hwm is None else send_hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        if setup is not None:
            setup(sock)
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)  # a socket left open would keep its context from terminating
        raise
    return sock


def backoff_reconnects(sock: zmq.Socket) -> None:
    """A connecting socket retries after 0.1 s and backs off to one try a second while its
    peer stays away: a restarted peer is found again at once, a gone one costs little."""
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def drain_router(sock: zmq.Socket, limit: int) -> Iterator[tuple[bytes, bytes]]:
    """(identity, payload) of the messages waiting on a ROUTER, at most `limit`, so that a
    busy peer never starves the other sockets of its reader's loop. A frame with no
    payload (a peer that speaks some other protocol) is skipped."""
    for _ in range(limit):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) >= 2:
            yield frames[0], frames[1]


def offset_port(address: str, offset: int) -> str | None:
    """tcp://HOST:PORT as tcp://HOST:(PORT + offset) (the port a data-parallel rank takes, as vLLM
    offsets them); None for an address of another form."""
    head, sep, port = address.rpartition(":")
    if address.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + offset}"
    return None
