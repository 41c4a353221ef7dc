"""Publishes the prefix cache's changes as vLLM's KV-cache events (protocol/kv_events.py).

The block pool appends a raw record to a list whenever a key enters or leaves its cache
(scheduler/block_pool.py); after each planned step the scheduler process hands that
list's contents to `KVEventPublisher.flush`, which queues them and returns. A thread
turns the records into one `KVEventBatch`, sends it on the PUB socket and keeps it
for replay, so the step loop pays a list swap and a queue put per step with events,
and nothing at all with events off (the pool's list is None then). Nothing here can
block the scheduler: a full queue drops the batch (counted, said once) and the PUB
socket drops what its high-water mark does not hold, as ZMQ's PUB always does.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import threading
import time
from collections import deque

import msgspec
import zmq

from noria.protocol.kv_events import (
    END_SEQ,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    external_hash,
)
from noria.protocol.sockets import make_socket, offset_port
from noria.scheduler.block_pool import BlockPool
from noria.scheduler.kv_cache_manager import KVCacheManager

log = logging.getLogger("noria.scheduler")

Record = tuple[bytes, bytes | None, bytes] | bytes | None  # stored, removed, or None: all cleared


def to_events(records: list[Record], block_size: int) -> list[KVCacheEvent]:
    """The pool's records as vLLM's events, in order. A run of stores that chain (each
    after the one before) is one BlockStored, as vLLM sends the blocks it caches at once;
    a run of removals is one BlockRemoved."""
    unpack = struct.Struct(f"<{block_size}q").unpack
    events: list[KVCacheEvent] = []
    last = None  # the event a record may extend
    last_key: bytes | None = None
    for rec in records:
        if rec is None:
            events.append(AllBlocksCleared())
            last = None
        elif isinstance(rec, bytes):
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(external_hash(rec))
            else:
                last = BlockRemoved([external_hash(rec)], MEDIUM, group_idx=0)
                events.append(last)
        else:
            key, parent, tokens = rec
            if isinstance(last, BlockStored) and parent is not None and parent == last_key:
                last.block_hashes.append(external_hash(key))
                last.token_ids.extend(unpack(tokens))
            else:
                last = BlockStored([external_hash(key)], None if parent is None else external_hash(parent),
                                   list(unpack(tokens)), block_size, None, MEDIUM, None, group_idx=0,
                                   kv_cache_spec_kind="full_attention")
                events.append(last)
            last_key = key
    return events


def _binds(endpoint: str) -> bool:
    # vLLM's rule, so that the same config means the same thing: a wildcard or a local
    # transport is bound (a stable address), anything else is a collector to connect to.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _rank_endpoint(endpoint: str, rank: int) -> str:
    """Engine `rank`'s endpoint: the port plus the rank, other transports' names with the rank appended."""
    return offset_port(endpoint, rank) or f"{endpoint}-{rank}"


class KVEventPublisher:
    """Owns the pool's event list, the ZMQ sockets and the publisher thread."""

    def __init__(self, ctx: zmq.Context, config: KVEventsConfig, block_size: int, rank: int = 0) -> None:
        """`rank`: the engine's data-parallel rank, in every batch; each of its ports is the configured
        one plus the rank (vLLM's offsets), so that the ranks of one host do not collide."""
        if rank:
            config = msgspec.structs.replace(
                config, endpoint=_rank_endpoint(config.endpoint, rank),
                replay_endpoint=_rank_endpoint(config.replay_endpoint, rank) if config.replay_endpoint else None)
        self.config = config
        self.block_size = block_size
        self.rank = rank
        self.records: list[Record] = []
        self._pool: BlockPool | None = None
        self._queue: queue.Queue[tuple[float, list[Record]] | None] = queue.Queue(config.max_queue_size)
        self.dropped = 0
        # A PUB socket only ever reads subscriptions (topic prefixes); the replay ROUTER only
        # 8-byte requests, and may queue one whole replay for a client.
        try:
            self.pub = make_socket(ctx, zmq.PUB, config.endpoint, bind=_binds(config.endpoint), hwm=1000,
                                   send_hwm=config.hwm, max_msg_size=1 << 16)
        except zmq.ZMQError as e:
            raise RuntimeError(f"--kv-events-config endpoint {config.endpoint!r}: {e}") from None
        self.replay: zmq.Socket | None = None
        if config.replay_endpoint:
            try:
                self.replay = make_socket(ctx, zmq.ROUTER, config.replay_endpoint, bind=True, hwm=1000,
                                          send_hwm=config.buffer_steps + 1, max_msg_size=1 << 10)
            except zmq.ZMQError as e:
                self.pub.close(linger=0)
                raise RuntimeError(f"--kv-events-config replay_endpoint {config.replay_endpoint!r}: {e}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # The sockets are the thread's from here on (handed over before it starts).
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events on %s%s", config.endpoint,
                 f" (replay {config.replay_endpoint})" if config.replay_endpoint else "")

    def attach(self, kv: KVCacheManager) -> None:
        """Record `kv`'s pool from now on; a pool that replaces one with cached blocks (a lost
        worker group takes its KV cache with it) clears them all."""
        old = self._pool
        if kv.pool is old:
            return
        if old is None:
            # A scheduler starts with an empty cache, but one that replaces a dead scheduler
            # (same endpoint, sequence numbers from 0 again) must tell subscribers that what its
            # predecessor published is gone: the first batch clears all.
            self.records.append(None)
        elif old.events is not None and old.cached:
            self.records.append(None)
        if old is not None:
            old.events = None
        # With prefix caching off, cached blocks serve only the samples of one request:
        # nothing a router could send elsewhere (vLLM publishes nothing then either).
        kv.pool.events = self.records if kv.enable_prefix_caching else None
        self._pool = kv.pool

    def flush(self) -> None:
        """Queue what the pool recorded since the last flush as one batch; never blocks."""
        if not self.records:
            return
        records = self.records.copy()
        self.records.clear()  # the pool keeps appending to this list
        try:
            self._queue.put_nowait((time.time(), records))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV-cache events: the publisher queue is full (%d batches); batches are dropped",
                            self.config.max_queue_size)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    # ---- the publisher thread ----------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        topic = self.config.topic.encode()
        seq = 0
        while True:
            if self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05 if self.replay is not None else 0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, records = item
            payload = encode(KVEventBatch(ts, to_events(records, self.block_size), self.rank))
            seq_bytes = seq.to_bytes(8, "big")
            # Again only from a connected collector that does not keep up: dropped, as PUB drops
            # for a slow subscriber; either can catch up through the replay socket.
            with contextlib.suppress(zmq.Again):
                self.pub.send_multipart((topic, seq_bytes, payload), zmq.NOBLOCK)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3:  # [identity, empty delimiter (REQ), start seq]
            log.warning("KV-cache events: a replay request of %d frames is ignored", len(frames))
            return
        ident, _, start = frames
        first = int.from_bytes(start, "big")
        try:
            for seq, payload in self._buffer:
                if seq >= first:
                    self.replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.replay.send_multipart((ident, b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV-cache events: a replay client stopped reading; its replay is cut short")
