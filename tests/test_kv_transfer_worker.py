"""Worker side of prefill/decode disaggregation: KVBlockServer serves held blocks, KVPuller
reads them into another cache, bit for bit, over a real ZeroMQ link on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from noria.protocol.codec import Codec
from noria.protocol.kv_transfer import KVBlocks, KVDataMessage, KVRead
from noria.protocol.step import KVPull
from noria.worker.kv_cache import KVCache, KVLayout
from noria.worker.kv_pull import KVPuller
from noria.worker.kv_pull_queue import PullQueue
from noria.worker.kv_server import KVBlockServer, layout_of

HOST = "127.0.0.1"
NUM_BLOCKS = 12
TIMEOUT = 5.0  # generous: a working server answers at once


def make_cache(dtype: torch.dtype = torch.float32, head_dim: int = 8, seed: int | None = None) -> KVCache:
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    cache = KVCache(layout, num_blocks=NUM_BLOCKS, num_cpu_blocks=0, device=torch.device("cpu"))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        real = cache.device_cache[:, :, :NUM_BLOCKS]
        cache.device_cache[:, :, :NUM_BLOCKS] = (torch.randn(real.shape, generator=g) * 3).to(dtype)
    return cache


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, whatever its dtype (fp8 has no equality of its own)."""
    return t.contiguous().view(torch.uint8)


def block(cache: KVCache, i: int) -> torch.Tensor:
    return raw(cache.device_cache[:, :, i])


def assert_zero_except(cache: KVCache, written: set[int]) -> None:
    for i in range(NUM_BLOCKS + 1):
        if i not in written:
            assert not block(cache, i).any(), f"block {i} was written"


@pytest.fixture
def closers() -> Iterator[list]:
    """Things to close at the end of a test, in reverse order, even when it fails."""
    items: list = []
    yield items
    for item in reversed(items):
        item.close()


def serve(closers: list, cache: KVCache) -> KVBlockServer:
    server = KVBlockServer(cache, HOST)
    closers.append(server)
    return server


def puller(closers: list, cache: KVCache, *, rank: int = 0, timeout: float = TIMEOUT,
           chunk_bytes: int | None = None) -> KVPuller:
    p = KVPuller(cache, rank, timeout, chunk_bytes if chunk_bytes is not None else 1 << 20)
    closers.append(p)
    return p


def pull_of(endpoints: list[str], tid: int, remote: list[int], local: list[int]) -> KVPull:
    return KVPull(req_id=7, transfer_id=tid, endpoints=endpoints, remote_block_ids=remote, local_block_ids=local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("blocks_per_read", [1, 2, 3])
def test_pull_copies_blocks_bit_for_bit(closers: list, dtype: torch.dtype, blocks_per_read: int) -> None:
    producer = make_cache(dtype, seed=1)
    before = producer.device_cache.clone()
    consumer = make_cache(dtype)
    server = serve(closers, producer)
    remote, local = [5, 2, 9], [0, 7, 3]
    server.hold(11, remote)
    bpb = producer.layout.bytes_per_block
    p = puller(closers, consumer, chunk_bytes=bpb * blocks_per_read)

    nbytes, error = p.pull(pull_of([server.endpoint], 11, remote, local))

    assert error is None
    assert nbytes == len(remote) * bpb
    assert server.reads == -(-len(remote) // blocks_per_read)  # that many pieces
    for r, loc in zip(remote, local, strict=True):
        assert torch.equal(block(consumer, loc), raw(before[:, :, r])), f"remote {r} -> local {loc}"
        assert block(consumer, loc).any()  # the seeded values, not zeros that happen to match
    assert_zero_except(consumer, set(local))
    assert torch.equal(raw(producer.device_cache), raw(before))  # a read changes nothing there


def test_pull_of_subset_in_another_order(closers: list) -> None:
    producer = make_cache(torch.bfloat16, seed=2)
    consumer = make_cache(torch.bfloat16)
    server = serve(closers, producer)
    server.hold(3, [1, 4, 6, 8])
    p = puller(closers, consumer, chunk_bytes=1)  # below one block: still one block a read

    nbytes, error = p.pull(pull_of([server.endpoint], 3, [8, 1], [10, 11]))

    assert error is None and nbytes == 2 * producer.layout.bytes_per_block
    assert server.reads == 2
    assert torch.equal(block(consumer, 10), block(producer, 8))
    assert torch.equal(block(consumer, 11), block(producer, 1))
    assert_zero_except(consumer, {10, 11})


def test_released_transfer_is_not_served(closers: list) -> None:
    producer = make_cache(seed=3)
    consumer = make_cache()
    server = serve(closers, producer)
    server.hold(21, [1, 2])
    server.hold(22, [3])
    server.release([21])
    p = puller(closers, consumer)

    nbytes, error = p.pull(pull_of([server.endpoint], 21, [1, 2], [4, 5]))

    assert nbytes == 0
    assert error is not None and "21" in error and "not held" in error
    assert_zero_except(consumer, set())
    # The other hold still serves; clear() drops it too.
    assert p.pull(pull_of([server.endpoint], 22, [3], [6])) == (producer.layout.bytes_per_block, None)
    server.clear()
    nbytes, error = p.pull(pull_of([server.endpoint], 22, [3], [8]))
    assert nbytes == 0 and error is not None and "not held" in error
    assert_zero_except(consumer, {6})


def test_never_held_transfer_is_refused(closers: list) -> None:
    consumer = make_cache()
    server = serve(closers, make_cache(seed=4))
    p = puller(closers, consumer)
    nbytes, error = p.pull(pull_of([server.endpoint], 99, [0], [0]))
    assert nbytes == 0 and error is not None and "not held" in error
    assert_zero_except(consumer, set())


def test_blocks_outside_the_hold_are_refused(closers: list) -> None:
    producer = make_cache(seed=5)
    consumer = make_cache()
    server = serve(closers, producer)
    server.hold(31, [5, 2, 9])
    p = puller(closers, consumer)  # one read for the whole pull

    nbytes, error = p.pull(pull_of([server.endpoint], 31, [5, 4, 9], [0, 1, 2]))

    assert nbytes == 0
    assert error is not None and "other blocks" in error
    assert_zero_except(consumer, set())


def test_refusal_mid_pull_reports_what_was_written(closers: list) -> None:
    """Read block by block, the held first block lands before the unheld second is refused:
    the pull fails and says how many bytes it wrote."""
    producer = make_cache(seed=6)
    consumer = make_cache()
    server = serve(closers, producer)
    server.hold(32, [5, 2])
    bpb = producer.layout.bytes_per_block
    p = puller(closers, consumer, chunk_bytes=bpb)

    nbytes, error = p.pull(pull_of([server.endpoint], 32, [5, 4], [0, 1]))

    assert error is not None and "other blocks" in error
    assert nbytes == bpb
    assert torch.equal(block(consumer, 0), block(producer, 5))
    assert_zero_except(consumer, {0})


@pytest.mark.parametrize(("theirs", "ours"), [
    ((torch.float32, 8), (torch.float32, 16)),
    ((torch.float32, 8), (torch.bfloat16, 8)),
    # The same bytes per block: only the layout check tells them apart.
    ((torch.bfloat16, 8), (torch.float8_e4m3fn, 16)),
    ((torch.bfloat16, 8), (torch.float16, 8)),
])
def test_other_layout_is_refused(closers: list, theirs: tuple, ours: tuple) -> None:
    producer = make_cache(theirs[0], head_dim=theirs[1], seed=7)
    consumer = make_cache(ours[0], head_dim=ours[1])
    server = serve(closers, producer)
    server.hold(41, [1, 2])
    p = puller(closers, consumer)

    nbytes, error = p.pull(pull_of([server.endpoint], 41, [1, 2], [3, 4]))

    assert nbytes == 0
    assert error is not None and "another layout" in error
    assert not raw(consumer.device_cache).any()


def test_bad_pulls_are_refused_before_any_read(closers: list) -> None:
    consumer = make_cache()
    server = serve(closers, make_cache(seed=8))
    server.hold(51, [1, 2])
    p = puller(closers, consumer)
    ep = [server.endpoint]

    nbytes, error = p.pull(pull_of(ep, 51, [1, 2], [3]))
    assert nbytes == 0 and error is not None and "pairs" in error
    nbytes, error = p.pull(pull_of(ep, 51, [1, 2], [3, NUM_BLOCKS]))  # the null block is not a target
    assert nbytes == 0 and error is not None and "out of range" in error
    nbytes, error = p.pull(pull_of(ep, 51, [1, 2], [-1, 3]))
    assert nbytes == 0 and error is not None and "out of range" in error
    assert server.reads == 0
    assert_zero_except(consumer, set())


def test_rank_reads_its_own_endpoint(closers: list) -> None:
    """Rank r pulls from endpoints[r]: two producer ranks hold different shards under the
    same transfer id, and each consumer rank gets its own."""
    prod0, prod1 = make_cache(seed=10), make_cache(seed=11)
    cons0, cons1 = make_cache(), make_cache()
    srv0, srv1 = serve(closers, prod0), serve(closers, prod1)
    srv0.hold(61, [2, 3])
    srv1.hold(61, [2, 3])
    endpoints = [srv0.endpoint, srv1.endpoint]
    p0 = puller(closers, cons0, rank=0)
    p1 = puller(closers, cons1, rank=1)

    assert p1.pull(pull_of(endpoints, 61, [2, 3], [5, 6]))[1] is None
    assert p0.pull(pull_of(endpoints, 61, [2, 3], [5, 6]))[1] is None

    for cons, prod in ((cons0, prod0), (cons1, prod1)):
        assert torch.equal(block(cons, 5), block(prod, 2))
        assert torch.equal(block(cons, 6), block(prod, 3))
    assert not torch.equal(block(cons0, 5), block(cons1, 5))
    assert (srv0.reads, srv1.reads) == (1, 1)

    p2 = puller(closers, make_cache(), rank=2)
    nbytes, error = p2.pull(pull_of(endpoints, 61, [2], [5]))
    assert nbytes == 0 and error is not None and "rank 2" in error


class SilentProducer:
    """A ROUTER that takes reads and never answers."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{HOST}:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def received(self) -> int:
        n = 0
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_silent_producer_times_out_and_socket_is_dropped(closers: list) -> None:
    silent = SilentProducer()
    closers.append(silent)
    producer = make_cache(seed=12)
    consumer = make_cache()
    server = serve(closers, producer)
    server.hold(71, [4])
    p = puller(closers, consumer, timeout=0.5)
    pull = pull_of([silent.endpoint], 71, [4], [1])

    start = time.monotonic()
    nbytes, error = p.pull(pull)
    took = time.monotonic() - start

    assert nbytes == 0 and error is not None and "no answer" in error and silent.endpoint in error
    assert took >= 0.45  # it waited for the answer (no upper bound: CI shares its cores)
    assert silent.endpoint not in p.socks  # a late answer cannot meet a later read
    assert silent.received() == 1  # the read did reach it
    assert_zero_except(consumer, set())

    # The puller still works with a producer that answers...
    nbytes, error = p.pull(pull_of([server.endpoint], 71, [4], [1]))
    assert (nbytes, error) == (producer.layout.bytes_per_block, None)
    assert torch.equal(block(consumer, 1), block(producer, 4))
    # ...and a second try at the silent one times out again, on a fresh socket.
    nbytes, error = p.pull(pull)
    assert nbytes == 0 and error is not None and "no answer" in error


def test_nobody_listening_times_out(closers: list) -> None:
    silent = SilentProducer()
    endpoint = silent.endpoint
    silent.close()  # the port is now free: nothing listens there
    consumer = make_cache()
    p = puller(closers, consumer, timeout=0.5)
    nbytes, error = p.pull(pull_of([endpoint], 81, [0], [0]))
    assert nbytes == 0 and error is not None and "no answer" in error
    assert_zero_except(consumer, set())


def test_stale_answer_is_not_taken_for_a_later_read(closers: list) -> None:
    """A producer that answers a read's seq late (and a wrong one first): the puller skips
    an answer whose seq is not the current read's."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{HOST}:0")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    class Closer:
        def close(self) -> None:
            sock.close(linger=0)
            ctx.term()

    closers.append(Closer())
    producer = make_cache(seed=13)
    consumer = make_cache()
    p = puller(closers, consumer, timeout=0.5)

    # Answer by hand: first with a stale seq and garbage bytes, then with the read's own.
    codec: Codec[KVDataMessage] = Codec(KVDataMessage)
    bpb = producer.layout.bytes_per_block

    def fake() -> None:
        if not sock.poll(5000, zmq.POLLIN):
            return
        peer, body = sock.recv_multipart()
        read = codec.decode(body)
        assert isinstance(read, KVRead)
        stale = KVBlocks(read.seq - 1, layout_of(producer))
        sock.send_multipart([peer, codec.encode(stale), b"\xff" * (bpb * len(read.block_ids))])
        good = KVBlocks(read.seq, layout_of(producer))
        data = producer.device_cache[:, :, read.block_ids].contiguous().view(torch.uint8)
        sock.send_multipart([peer, codec.encode(good), data.numpy().tobytes()])

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    nbytes, error = p.pull(pull_of([endpoint], 91, [7], [2]))
    t.join(5.0)
    assert (nbytes, error) == (bpb, None)
    assert torch.equal(block(consumer, 2), block(producer, 7))
    assert_zero_except(consumer, {2})


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1", "garbage"])
def test_malformed_endpoint_is_a_failed_pull(endpoint: str) -> None:
    """Endpoints come from a request's kv_transfer_params: one that does not parse fails the
    pull (it raises nothing out of it)."""
    consumer = make_cache()
    p = KVPuller(consumer, 0, 0.5, 1 << 20)
    try:
        nbytes, error = p.pull(pull_of([endpoint], 1, [0], [0]))
        assert nbytes == 0 and error is not None and endpoint in error
        assert_zero_except(consumer, set())
    finally:
        assert close_within(p, 5.0), "KVPuller.close() hung"


def close_within(p: KVPuller, seconds: float) -> bool:
    """Close `p`; if that has not returned in `seconds`, close whatever sockets its context
    still has (so the hung ctx.term() returns and the test run goes on) and say False."""
    t = threading.Thread(target=p.close, daemon=True)
    t.start()
    t.join(seconds)
    if not t.is_alive():
        return True
    for sock in list(p.ctx._sockets):
        sock.close(linger=0)
    t.join(seconds)
    return False


def _outcome(q: PullQueue, req_id: int):
    """Wait (on the queue's own condition) until the pull of `req_id` has ended; its outcome."""
    while True:
        done = dict(q.snapshot())
        if done.get(req_id) is not None:
            return done[req_id]
        q.wait_any(1.0)


def test_pull_queue_runs_pulls_beside_the_caller_and_reports_each_once(closers: list) -> None:
    producer, consumer = make_cache(seed=21), make_cache()
    server = serve(closers, producer)
    server.hold(5, [1, 2])
    q = PullQueue(KVPuller(consumer, 0, TIMEOUT, 1 << 20))
    closers.append(q)
    q.submit([KVPull(1, 5, [server.endpoint], [1, 2], [3, 4]), KVPull(2, 99, [server.endpoint], [1], [5])])
    ok, refused = _outcome(q, 1), _outcome(q, 2)
    assert ok.ok and ok.nbytes == 2 * producer.layout.bytes_per_block and ok.error is None
    assert not refused.ok and "not held" in (refused.error or "")
    assert torch.equal(block(consumer, 3), block(producer, 1)) and torch.equal(block(consumer, 4), block(producer, 2))
    assert_zero_except(consumer, {3, 4})
    q.forget([1, 2])
    assert q.snapshot() == [] and q.outstanding == []


def test_cancel_all_stops_a_pull_waiting_on_a_silent_producer(closers: list) -> None:
    silent = SilentProducer()
    closers.append(silent)
    consumer = make_cache()
    q = PullQueue(KVPuller(consumer, 0, 3600.0, 1 << 20))  # it would wait an hour
    closers.append(q)
    q.submit([KVPull(1, 5, [silent.endpoint], [1], [3])])
    while silent.received() == 0:  # the read has gone out: the pull is waiting for its answer
        q.wait_any(0.05)
    q.cancel_all()  # returns once the thread writes nothing more
    assert q.snapshot() == [] and not q.busy
    assert_zero_except(consumer, set())
