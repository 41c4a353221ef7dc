"""A producer's worker rank serves the prompt blocks it holds to consumers (prefill/decode
disaggregation, protocol/kv_transfer.py).

A thread of its own answers each `KVRead` on a ROUTER, so that a read never waits for a step
(nor a step for a read), from a table of holds that the rank's main thread fills as its
producer requests sample (`hold`) and empties as plans say (`release`): the scheduler frees a
transfer's blocks only with a plan that releases it, which the main thread applies before the
step that could reuse them, and a read copies its blocks under the table's lock, so a read
either finds the hold and copies the prompt's KV, or finds none and says so; it never copies a
reused block. The blocks go as bytes in a second frame, [num_layers, 2, n, block_size,
num_kv_heads, head_dim] of the cache's own dtype.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import torch
import zmq

from noria.protocol.codec import Codec
from noria.protocol.kv_transfer import KVBlocks, KVDataMessage, KVLayout, KVRead
from noria.protocol.security import CurveServer, is_loopback
from noria.protocol.sockets import make_socket
from noria.worker.kv_cache import KVCache
from noria.worker.kv_fp8 import as_bytes

log = logging.getLogger("noria.worker")

MAX_READ_MESSAGE = 1 << 20  # a read names block ids only


def layout_of(cache: KVCache) -> KVLayout:
    lay = cache.layout
    return KVLayout(lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim, str(lay.dtype))


def gather_blocks(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """The blocks' K and V of every layer, on the host, contiguous bytes."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    data = as_bytes(cache.device_cache).index_select(2, idx)
    return data.cpu().contiguous().view(torch.uint8)


class KVBlockServer:
    def __init__(self, cache: KVCache, host: str, curve_folder: str | None = None) -> None:
        self.cache = cache
        self.layout = layout_of(cache)
        self.lock = threading.Lock()  # over `holds` and every read of the cache
        self.holds: dict[int, list[int]] = {}  # transfer id -> the prompt's blocks
        self.ctx = zmq.Context()
        # CURVE where the link leaves the host (with the engine's --curve-keys).
        self.curve = CurveServer(self.ctx, curve_folder) if curve_folder and not is_loopback(f"tcp://{host}:1") else None

        def setup(sock: zmq.Socket) -> None:
            if self.curve is not None:
                self.curve.apply(sock)

        self.sock = make_socket(self.ctx, zmq.ROUTER, f"tcp://{host}:0", bind=True, max_msg_size=MAX_READ_MESSAGE,
                                setup=setup)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec: Codec[KVDataMessage] = Codec(KVDataMessage)
        self.reads = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self.thread.start()

    # ---- the main thread ------------------------------------------------

    def hold(self, transfer_id: int, block_ids: list[int]) -> None:
        with self.lock:
            self.holds[transfer_id] = list(block_ids)

    def release(self, transfer_ids: list[int]) -> None:
        with self.lock:
            for tid in transfer_ids:
                self.holds.pop(tid, None)

    def clear(self) -> None:
        with self.lock:
            self.holds.clear()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5.0)
        self.sock.close(linger=0)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()

    # ---- the server thread ----------------------------------------------

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.sock.poll(100, zmq.POLLIN):
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) != 2:
                continue
            try:
                msg = self.codec.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(msg, KVRead):
                try:
                    self._answer(frames[0], msg)
                except Exception as e:  # noqa: BLE001 - one read that breaks fails; the server serves on
                    log.exception("a KV read of transfer %d failed", msg.transfer_id)
                    self.sock.send_multipart([frames[0], self.codec.encode(KVBlocks(msg.seq, None, repr(e)))])

    def _answer(self, peer: bytes, read: KVRead) -> None:
        data = None
        with self.lock:
            held = self.holds.get(read.transfer_id)
            if held is None:
                error = f"transfer {read.transfer_id} is not held here (released, expired, or never made)"
            elif not set(read.block_ids) <= set(held):
                error = f"transfer {read.transfer_id} holds other blocks than those read"
            else:
                error = None
                data = gather_blocks(self.cache, read.block_ids)
        self.reads += 1
        if data is None:
            self.sock.send_multipart([peer, self.codec.encode(KVBlocks(read.seq, None, error))])
            return
        self.sock.send_multipart([peer, self.codec.encode(KVBlocks(read.seq, self.layout)), data.numpy()],
                                 copy=False)
