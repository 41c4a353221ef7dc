"""The schedulers' side channel of prefill/decode disaggregation: consumers release transfers.

A producer binds a ROUTER at `kv_ip:kv_port` (plus its data-parallel rank), the
`remote_host`/`remote_port` of the params it answers with; a consumer keeps a DEALER per
producer it has pulled from and sends each `KVRelease` without blocking (a producer that is
gone frees its blocks at its timeout anyway, so a release may be lost, never waited for).
Where the link leaves the host, with the engine's `--curve-keys`, both ends speak CURVE with the key folder the engines share:
the producer serves with its scheduler pair, the consumer connects with the folder's one
worker pair, which the producer's authorized/ lists.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from noria.protocol.codec import Codec
from noria.protocol.kv_transfer import KVRelease, KVTransferConfig
from noria.protocol.security import CurveServer, apply_curve_client, is_loopback
from noria.protocol.sockets import drain_router, make_socket

log = logging.getLogger("noria.scheduler")

MAX_SIDE_MESSAGE = 1 << 20
CLIENT_HWM = 10_000  # releases queued for one producer at most (then they are dropped)
MAX_PRODUCERS = 64  # producers kept connected at once


class SideChannel:
    def __init__(self, ctx: zmq.Context, config: KVTransferConfig, rank: int, curve: CurveServer | None,
                 curve_keys: str | None) -> None:
        self.ctx = ctx
        self.curve_keys = curve_keys
        self.codec: Codec[KVRelease] = Codec(KVRelease)
        self.server: zmq.Socket | None = None
        self.address: tuple[str, int] | None = None
        if config.produces:
            host, port = config.kv_ip, config.kv_port + rank

            def setup(sock: zmq.Socket) -> None:
                if curve is not None and not is_loopback(f"tcp://{host}:{port}"):
                    curve.apply(sock)

            try:
                self.server = make_socket(ctx, zmq.ROUTER, f"tcp://{host}:{port}", bind=True,
                                          max_msg_size=MAX_SIDE_MESSAGE, setup=setup)
            except zmq.ZMQError as e:
                raise RuntimeError(f"--kv-transfer-config: cannot bind the side channel on {host}:{port}: {e}") from None
            self.address = (host, port)
        self.clients: dict[tuple[str, int], zmq.Socket] = {}

    def receive(self) -> list[int]:
        """Transfer ids released since the last call (a message that is not one is dropped)."""
        out: list[int] = []
        if self.server is None:
            return out
        for _, payload in drain_router(self.server, 1024):
            try:
                out += self.codec.decode(payload).transfer_ids
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("the KV side channel dropped a message that is not a KVRelease")
        return out

    def send(self, releases: list[tuple[str, int, int]]) -> None:
        by_producer: dict[tuple[str, int], list[int]] = {}
        for host, port, tid in releases:
            by_producer.setdefault((host, port), []).append(tid)
        for where, tids in by_producer.items():
            sock = self.clients.get(where)
            if sock is None:
                if len(self.clients) >= MAX_PRODUCERS:  # the oldest goes: addresses come from clients
                    self.clients.pop(next(iter(self.clients))).close(linger=0)
                try:
                    sock = self.clients[where] = self._connect(*where)
                except zmq.ZMQError as e:  # an address from a client's params that does not parse
                    log.warning("cannot release KV transfers at %s:%s: %s", *where, e)
                    continue
            try:
                sock.send(self.codec.encode(KVRelease(tids)), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("the producer at %s:%d does not take KV releases: it frees them at its timeout", *where)

    def _connect(self, host: str, port: int) -> zmq.Socket:
        def setup(sock: zmq.Socket) -> None:
            if self.curve_keys and not is_loopback(f"tcp://{host}:{port}"):
                apply_curve_client(sock, self.curve_keys)

        return make_socket(self.ctx, zmq.DEALER, f"tcp://{host}:{port}", bind=False, hwm=CLIENT_HWM,
                           max_msg_size=MAX_SIDE_MESSAGE, setup=setup)

    def close(self) -> None:
        for sock in [self.server, *self.clients.values()]:
            if sock is not None:
                sock.close(linger=200)
