"""A consumer's worker rank pulls a prompt's blocks from the producer's rank of the same index
(prefill/decode disaggregation, protocol/kv_transfer.py).

A pull writes straight into the rank's cache, into blocks nothing else reads or writes until
its outcome is reported (worker/kv_pull_queue.py runs it beside the steps). It reads
in pieces of at most `chunk_bytes`, one at a time, each answer checked against the read it
answers (`seq`) and against this rank's own block layout; anything else (no answer within
`transfer_timeout` for the whole pull, the producer's refusal, another layout) fails it, and the
scheduler computes the prompt here instead. A socket that timed out is closed, so that a late
answer cannot be taken for a later read's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from noria.protocol.codec import Codec
from noria.protocol.kv_transfer import KVBlocks, KVDataMessage, KVRead
from noria.protocol.security import apply_curve_client, is_loopback
from noria.protocol.sockets import backoff_reconnects, make_socket
from noria.protocol.step import KVPull
from noria.worker.kv_cache import KVCache
from noria.worker.kv_fp8 import as_bytes
from noria.worker.kv_server import layout_of

MAX_PRODUCER_RANKS = 64  # producer ranks kept connected at once
CANCEL_CHECK_SECONDS = 0.1  # a pull waiting for an answer hears of a cancel this soon


class PullFailed(Exception):
    pass


class KVPuller:
    def __init__(self, cache: KVCache, rank: int, timeout: float, chunk_bytes: int,
                 curve_folder: str | None = None) -> None:
        self.cache = cache
        self.rank = rank
        self.timeout = timeout
        self.layout = layout_of(cache)
        self.block_bytes = cache.layout.bytes_per_block
        self.per_read = max(1, chunk_bytes // self.block_bytes)
        self.curve_folder = curve_folder
        self.ctx = zmq.Context()
        self.codec: Codec[KVDataMessage] = Codec(KVDataMessage)
        self.socks: dict[str, zmq.Socket] = {}
        self.seq = 0

    def pull(self, pull: KVPull, cancelled: Callable[[], bool] = lambda: False) -> tuple[int, str | None]:
        """Bytes written, and why the pull failed (None: every block arrived). The whole pull has
        `timeout` seconds; `cancelled` is asked between pieces."""
        if len(pull.remote_block_ids) != len(pull.local_block_ids):
            return 0, "the pull pairs no remote block with each local one"
        if self.rank >= len(pull.endpoints):
            return 0, f"the producer has no rank {self.rank}"
        endpoint = pull.endpoints[self.rank]
        written = 0
        deadline = time.monotonic() + self.timeout
        try:
            self.cache.check_blocks(pull.local_block_ids, f"pull for request {pull.req_id}")
            for i in range(0, len(pull.remote_block_ids), self.per_read):
                if cancelled():
                    return written, "cancelled"
                remote = pull.remote_block_ids[i:i + self.per_read]
                local = pull.local_block_ids[i:i + self.per_read]
                written += self._read_into(endpoint, pull.transfer_id, remote, local, deadline, cancelled)
        except (PullFailed, ValueError) as e:
            return written, str(e)
        except zmq.ZMQError as e:  # an endpoint that does not parse (the params come from clients)
            return written, f"cannot reach {endpoint}: {e}"
        return written, None

    def _read_into(self, endpoint: str, transfer_id: int, remote: list[int], local: list[int],
                   deadline: float, cancelled: Callable[[], bool]) -> int:
        sock = self._socket(endpoint)
        self.seq += 1
        sock.send(self.codec.encode(KVRead(self.seq, transfer_id, remote)))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or cancelled():
                self._drop(endpoint)
                raise PullFailed("cancelled" if left > 0 else f"no answer from {endpoint} in {self.timeout:g}s")
            if not sock.poll(int(min(left, CANCEL_CHECK_SECONDS) * 1000) + 1, zmq.POLLIN):
                continue
            frames = sock.recv_multipart()
            try:
                answer = self.codec.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._drop(endpoint)
                raise PullFailed(f"{endpoint} answered something else than blocks: {e}") from None
            if isinstance(answer, KVBlocks) and answer.seq == self.seq:
                break
        if answer.error is not None or answer.layout is None:
            raise PullFailed(f"{endpoint}: {answer.error}")
        if answer.layout != self.layout:
            raise PullFailed(f"{endpoint} holds blocks of another layout ({answer.layout}, here {self.layout})")
        if len(frames) != 2 or len(frames[1]) != self.block_bytes * len(remote):
            raise PullFailed(f"{endpoint} sent {len(frames[1]) if len(frames) > 1 else 0} bytes for "
                             f"{len(remote)} blocks of {self.block_bytes}")
        self._write(local, frames[1])
        return len(frames[1])

    def _write(self, local: list[int], data: bytes) -> None:
        cache = self.cache
        target = as_bytes(cache.device_cache)
        lay = cache.layout
        shape = (lay.num_layers, 2, len(local), lay.block_size, lay.num_kv_heads, lay.head_dim)
        blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target.dtype).view(shape)
        idx = torch.tensor(local, dtype=torch.long, device=cache.device)
        target.index_copy_(2, idx, blocks.to(cache.device, non_blocking=False))

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.socks.get(endpoint)
        if sock is None:
            if len(self.socks) >= MAX_PRODUCER_RANKS:  # the oldest goes: endpoints come from clients
                self._drop(next(iter(self.socks)))
            def setup(s: zmq.Socket) -> None:
                backoff_reconnects(s)
                if self.curve_folder and not is_loopback(endpoint):
                    apply_curve_client(s, self.curve_folder)

            sock = self.socks[endpoint] = make_socket(self.ctx, zmq.DEALER, endpoint, bind=False, setup=setup)
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self.socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for endpoint in list(self.socks):
            self._drop(endpoint)
        self.ctx.term()
