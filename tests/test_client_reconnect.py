"""`noria.Client` when the engine goes away: requests fail quickly and clearly
(no hang), and the same client reconnects when an engine is back."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from noria import Client, NoriaError, SamplingParams
from noria.protocol.sockets import free_tcp_port
from tests.procs import alive, children_of, serve_http, wait_ready

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "256")


def _start(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "noria.frontend.cli", "serve", "--zmq-port", str(port),
                             "--port", str(free_tcp_port()), *ENGINE_ARGS])


def test_engine_gone_fails_fast_then_the_client_reconnects(demo_path):
    port = free_tcp_port()
    address = f"tcp://127.0.0.1:{port}"
    first = _start(port)
    try:
        wait_ready(address, first)
        kids = children_of(first.pid)
        with Client(address, timeout=None) as c:
            assert c.generate("before", GREEDY).outputs[0].token_ids
            stream = c.stream("long", SamplingParams(max_tokens=3000, ignore_eos=True))
            next(stream)
            first.send_signal(signal.SIGKILL)
            first.wait()
            t0 = time.monotonic()
            with pytest.raises(NoriaError) as lost:
                for _ in stream:
                    pass
            assert lost.value.code == "engine_unreachable" and address in lost.value.message
            assert time.monotonic() - t0 < 5, "a vanished engine must not hang the caller"

            t0 = time.monotonic()
            with pytest.raises(NoriaError) as down:
                c.generate("while down", GREEDY)
            assert down.value.code == "engine_unreachable" and time.monotonic() - t0 < 1
            assert not c.connected

            # The same client, untouched, works again once a server is back on the address.
            with serve_http(*ENGINE_ARGS, zmq_port=port, wait_bridge=False):
                deadline = time.monotonic() + 30
                while not c.connected and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert c.connected
                assert len(c.generate("after", GREEDY).outputs[0].token_ids) == 8
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(k) for k in kids), "engine or bridge processes outlived a killed server"


def test_a_silent_server_is_detected_by_the_heartbeat():
    """A peer that accepts the connection but never answers (a hung engine)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def swallow() -> None:
        while not stop.is_set():
            if router.poll(50):
                router.recv_multipart()

    t = threading.Thread(target=swallow, daemon=True)
    t.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=None, heartbeat_interval=0.2, heartbeat_timeout=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(NoriaError) as e:
                c.generate("anyone?", GREEDY)
            assert e.value.code == "engine_unreachable" and "no answer" in e.value.message
            assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        t.join()
        router.close(0)
        ctx.term()


def test_a_server_that_answers_late_is_reconnected_to():
    """hello() waits (up to `timeout`) for an engine that is not there yet."""
    port = free_tcp_port()
    address = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    ready = {"type": "ready", "protocol_version": 1, "model": "fake", "max_model_len": 64, "vocab_size": 10}
    with Client(address, timeout=10, heartbeat_interval=0.2, heartbeat_timeout=0.5) as c:
        # Nobody answers: the heartbeat declares the engine unreachable, which fails the request
        # well before its own 10 s timeout ...
        t0 = time.monotonic()
        with pytest.raises(NoriaError) as e:
            c.generate("anyone?", GREEDY)
        assert e.value.code == "engine_unreachable" and "no answer" in e.value.message
        assert time.monotonic() - t0 < 5 and not c.connected
        # ... and from then on new requests fail at once, until the server answers.
        t0 = time.monotonic()
        with pytest.raises(NoriaError, match="retrying") as e:
            c.generate("still nobody?", GREEDY)
        assert e.value.code == "engine_unreachable" and time.monotonic() - t0 < 1
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)

        def answer() -> None:
            while router.poll(3000):
                ident, payload = router.recv_multipart()
                if msgspec.msgpack.decode(payload)["type"] == "hello":
                    router.send_multipart([ident, msgspec.msgpack.encode(ready)])

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        assert c.hello().model == "fake"
        assert c.connected
    t.join()
    router.close(0)
    ctx.term()
