"""KV-cache events (`--kv-events-config`) read as vLLM's subscribers read them.

The subscriber side here is written from vLLM's documented format, not from noria's
classes: its own msgspec Structs (a positional batch of tagged-map events), plain pyzmq
SUB and REQ sockets. Unit tests drive the scheduler with the fake worker and check that
the cached keys rebuilt from the events equal the pool's after every step; the
integration test runs `noria serve` and checks blocks, parent links, sequence numbers
and replay on loopback.
"""

from __future__ import annotations

import json
import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from noria import Client, SamplingParams
from noria.bench.fake_worker import FakeWorker
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.kv_events import KVEventBatch, KVEventsConfig, parse_kv_events_config
from noria.protocol.sampling import EngineSamplingParams
from noria.scheduler.kv_events import KVEventPublisher, to_events
from noria.scheduler.scheduler import Scheduler
from tests.procs import serve_http

# ---- the subscriber's view of the wire (vLLM's format, written independently) ---------------


class Ev(msgspec.Struct, tag=True):
    pass


class BlockStored(Ev):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(Ev):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Ev):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(Batch).decode
BS = 4
VOCAB = 50


def _hash(key: bytes) -> int:  # the subscriber's expectation: the key's low 64 bits, big-endian
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


class Model:
    """A consumer's index: the set of cached hashes the events say there are."""

    def __init__(self) -> None:
        self.cached: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, its block's tokens)

    def apply(self, batch: Batch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert h not in self.cached, "stored twice without a removal"
                    self.cached[h] = (parent, ev.token_ids[i * BS : (i + 1) * BS])
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.cached, "removed a block never stored"
                    del self.cached[h]
            else:
                self.cached.clear()


def _inproc_config(name: str, **kw: Any) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"inproc://{name}", **kw)


def _add(s: Scheduler, rid: int, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
    s.add_request(EngineRequest(rid, prompt, EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                [VOCAB - 1], 0, cache_salt=salt))


def _take_batch(pub: KVEventPublisher) -> Batch | None:
    """What `flush` would queue, encoded and decoded as a subscriber would see it."""
    if not pub.records:
        return None
    events = to_events(pub.records.copy(), BS)
    pub.records.clear()
    return DECODE(msgspec.msgpack.encode(KVEventBatch(time.time(), events, 0)))


def _check(model: Model, s: Scheduler) -> None:
    pool = s.kv.pool
    assert set(model.cached) == {_hash(k) for k in pool.cached}
    for key, block in pool.cached.items():  # and each block's tokens are what the event said
        packed = pool.tokens[block] or b""
        ids = [int.from_bytes(packed[i : i + 8], "little", signed=True) for i in range(0, len(packed), 8)]
        assert model.cached[_hash(key)][1] == ids


_names = iter(range(1_000_000))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14), st.sampled_from([None, "t1"]),
                          st.integers(1, 6), st.booleans()), min_size=1, max_size=14),
       st.integers(10, 24))
def test_events_rebuild_the_cached_set_after_every_step(reqs, num_blocks):
    """Stores, hits, LRU evictions (a small pool) and resets (a lost worker group): the
    hashes a subscriber rebuilds from the events are the pool's cached keys, step by step."""
    ctx = zmq.Context.instance()
    s = Scheduler(EngineConfig(block_size=BS), num_blocks, 10_000)
    pub = KVEventPublisher(ctx, _inproc_config(f"kv-unit-{next(_names)}"), BS)
    try:
        pub.attach(s.kv)
        w = FakeWorker(num_blocks, BS, vocab=VOCAB)
        model = Model()
        prefixes = [[random.Random(p).randrange(VOCAB - 1) for _ in range(16)] for p in range(4)]
        for rid, (p, extra, salt, max_tokens, reset) in enumerate(reqs):
            prompt = prefixes[p][: 2 + extra % 14] + [rid % (VOCAB - 1)] * (extra % 5)
            _add(s, rid, prompt, max_tokens, salt)
            for _ in range(3):
                if not s.has_work():
                    break
                plan = s.schedule()
                batch = _take_batch(pub)
                if batch is not None:
                    model.apply(batch)
                _check(model, s)
                s.update_from_result(w.execute(plan))
                s.take_updates()
            if reset:
                s.reset_after_worker_loss()
                pub.attach(s.kv)
                w = FakeWorker(num_blocks, BS, vocab=VOCAB)
                batch = _take_batch(pub)
                if batch is not None:
                    assert isinstance(batch.events[-1], AllBlocksCleared)
                    model.apply(batch)
                _check(model, s)
        while s.has_work():
            plan = s.schedule()
            batch = _take_batch(pub)
            if batch is not None:
                model.apply(batch)
            _check(model, s)
            s.update_from_result(w.execute(plan))
            s.take_updates()
        assert s.check_blocks() is None
    finally:
        pub.close()


def test_a_salted_block_never_shares_a_hash_with_an_unsalted_one():
    prompt = list(range(1, 3 * BS + 1))
    keys = {}
    for salt in (None, "tenant-a", "tenant-b"):
        s = Scheduler(EngineConfig(block_size=BS), 16, 10_000)
        _add(s, 0, prompt + [7], 1, salt)
        r = s.requests[0]
        s.kv.get_computed_blocks(r)
        keys[salt] = [_hash(k) for k in r.block_hashes]
    for a in keys:
        for b in keys:
            if a != b:  # every block differs, not only the first: the chain carries the salt
                assert not set(keys[a]) & set(keys[b])


def test_no_events_are_recorded_with_events_off():
    s = Scheduler(EngineConfig(block_size=BS), 16, 10_000)
    assert s.kv.pool.events is None
    _add(s, 0, list(range(1, 10)), 2)
    s.schedule()
    assert s.kv.pool.events is None


def test_publisher_sends_batches_in_order_and_replays_them():
    ctx = zmq.Context.instance()
    name = f"kv-pub-{next(_names)}"
    pub = KVEventPublisher(ctx, _inproc_config(name, replay_endpoint=f"inproc://{name}-replay", topic="kv"), BS)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"inproc://{name}")
    try:
        pub.records.extend([(b"\x01" * 32, None, bytes(8 * BS)), (b"\x02" * 32, b"\x01" * 32, bytes(8 * BS))])
        pub.flush()
        pub.records.append(b"\x01" * 32)
        pub.flush()
        got = [_recv(sub) for _ in range(2)]
        assert [seq for seq, _ in got] == [0, 1]
        first = got[0][1].events
        assert len(first) == 1 and isinstance(first[0], BlockStored)  # a chain is one event
        assert first[0].block_hashes == [_hash(b"\x01" * 32), _hash(b"\x02" * 32)]
        assert first[0].parent_block_hash is None and first[0].token_ids == [0] * (2 * BS)
        assert isinstance(got[1][1].events[0], BlockRemoved)
        assert [seq for seq, _ in _replay(ctx, f"inproc://{name}-replay", 1)] == [1]
    finally:
        sub.close(linger=0)
        pub.close()


def _recv(sub: zmq.Socket, timeout_ms: int = 10_000) -> tuple[int, Batch]:
    assert sub.poll(timeout_ms), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return int.from_bytes(seq, "big"), DECODE(payload)


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, Batch]]:
    """A replay client: the start sequence goes to the ROUTER as a REQ would send it (after
    an empty delimiter), and `[seq, payload]` batches come back until an empty payload with
    sequence -1. A DEALER, because a REQ socket takes only the first reply of the many."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    out = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert sock.poll(10_000), "the replay did not end"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq, "big"), DECODE(payload)))
    finally:
        sock.close(linger=0)


# ---- the flag -------------------------------------------------------------------------


def test_the_flag_takes_vllms_keys_and_refuses_the_rest():
    cfg = msgspec.convert(parse_kv_events_config('{"enable_kv_cache_events": true}'), KVEventsConfig)
    assert cfg.publishes and cfg.endpoint == "tcp://*:5557" and cfg.buffer_steps == 10_000 and cfg.topic == ""
    assert not msgspec.convert(parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}'),
                               KVEventsConfig).publishes
    assert not KVEventsConfig().publishes
    for bad, word in [('{"enable_kv_cache_event": true}', "no key"), ('{"publisher": "kafka"}', "zmq"),
                      ('{"buffer_steps": 0}', "buffer_steps"), ("[]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(bad)


# ---- a live server --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_publishes_blocks_subscribers_can_index(demo_path):
    pub_port, replay_port = _free_port(), _free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
           "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv-events"}
    bs = 16  # the demo's default --block-size
    rng = random.Random(7)
    shared = [rng.randrange(3, 200) for _ in range(3 * bs)]
    first, second = shared + [5] * (bs + 3), shared + [6] * (bs + 3)
    ctx = zmq.Context()
    with serve_http("--kv-events-config", json.dumps(cfg), "--num-kv-blocks", "64", "--max-model-len", "256",
                    wait_bridge=False) as served:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        try:
            with Client(served.address) as c:
                c.generate(first, SamplingParams(max_tokens=2))
                assert c.generate(second, SamplingParams(max_tokens=2)).num_cached_tokens == 3 * bs
            # The live stream may miss its start (a SUB joins late); the replay has it all.
            live: list[tuple[int, Batch]] = []
            deadline = time.monotonic() + 30
            stored: dict[int, tuple[int | None, list[int]]] = {}
            while time.monotonic() < deadline:
                replayed = _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
                stored = {}
                for _, batch in replayed:
                    for ev in batch.events:
                        if isinstance(ev, BlockStored):
                            assert ev.block_size == bs and len(ev.token_ids) == bs * len(ev.block_hashes)
                            parent = ev.parent_block_hash
                            for i, h in enumerate(ev.block_hashes):
                                stored[h] = (parent, ev.token_ids[i * bs : (i + 1) * bs])
                                parent = h
                if len(stored) >= 8:  # 4 full prompt blocks of each request, 3 of them shared
                    break
                time.sleep(0.05)
            assert [seq for seq, _ in replayed] == list(range(len(replayed))), "sequence numbers go 0, 1, 2, ..."
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events"
                live.append((int.from_bytes(seq, "big"), DECODE(payload)))
            seqs = [s for s, _ in live]
            assert seqs == sorted(seqs) and all(s < len(replayed) for s in seqs)
            by_seq = dict(replayed)
            assert all(by_seq[s] == b for s, b in live), "a live batch differs from its replay"
        finally:
            sub.close(linger=0)
    ctx.term()

    def chain(prompt: list[int]) -> list[int]:
        """The hashes of `prompt`'s full blocks, found by following parent links from None."""
        hashes: list[int] = []
        parent = None
        for i in range(len(prompt) // bs):
            block = prompt[i * bs : (i + 1) * bs]
            found = [h for h, (p, toks) in stored.items() if p == parent and toks == block]
            assert len(found) == 1, f"block {i}: {len(found)} stored blocks follow the chain"
            parent = found[0]
            hashes.append(parent)
        return hashes

    a, b = chain(first), chain(second)
    assert a[:3] == b[:3], "the shared prefix is one chain"
    assert a[3] != b[3] and stored[b[3]][0] == a[2], "the second request's own block hangs off the shared ones"
