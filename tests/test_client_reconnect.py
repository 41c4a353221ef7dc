"""`noria.Client` when the engine goes away: requests fail quickly and clearly
(no hang), and the same client reconnects when an engine is back."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import msgspec
import pytest
import zmq

from noria import Client, NoriaError, SamplingParams
from noria.protocol.sockets import free_tcp_port
from tests.procs import children_of, serve_http, wait_gone, wait_ready
from tests.workers import wait_for

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "256")
HANG = 60.0  # s: a call still waiting this long hangs (a slow machine answers in a few)


def _bounded(fn: Callable[[], object]) -> object:
    """`fn()` on a thread: its result, or its exception raised here; fails if it is still
    running after HANG seconds. The calls under test wait with no timeout of their own."""
    out: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it was
            out.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    assert out, f"still waiting after {HANG}s: the call hangs"
    ok, value = out[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value


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
            stream = c.stream("long", SamplingParams(max_tokens=None, ignore_eos=True))
            next(stream)
            first.send_signal(signal.SIGKILL)
            first.wait()
            # The dropped connection fails the stream, not the heartbeat's silence (seconds later).
            with pytest.raises(NoriaError) as lost:
                _bounded(lambda: [None for _ in stream])
            assert lost.value.code == "engine_unreachable" and address in lost.value.message
            assert "lost the connection" in lost.value.message, lost.value.message

            # Known down: a new request fails before it is sent, not after a heartbeat's wait.
            with pytest.raises(NoriaError) as down:
                _bounded(lambda: c.generate("while down", GREEDY))
            assert down.value.code == "engine_unreachable" and "retrying in the background" in down.value.message
            assert not c.connected

            # The same client, untouched, works again once a server is back on the address.
            with serve_http(*ENGINE_ARGS, zmq_port=port, wait_bridge=False):
                wait_for("the client to reconnect", lambda: c.connected, HANG)
                assert len(c.generate("after", GREEDY).outputs[0].token_ids) == 8
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not wait_gone(kids, HANG), "engine or bridge processes outlived a killed server"


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
            with pytest.raises(NoriaError) as e:
                _bounded(lambda: c.generate("anyone?", GREEDY))
            assert e.value.code == "engine_unreachable" and "no answer" in e.value.message
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
    with Client(address, timeout=HANG, heartbeat_interval=0.2, heartbeat_timeout=0.5) as c:
        # Nobody answers: the heartbeat declares the engine unreachable, which fails the request
        # (engine_unreachable, not its own timeout's `timeout`) ...
        with pytest.raises(NoriaError) as e:
            c.generate("anyone?", GREEDY)
        assert e.value.code == "engine_unreachable" and "no answer" in e.value.message
        assert not c.connected
        # ... and from then on new requests fail before they are sent, until the server answers.
        with pytest.raises(NoriaError, match="retrying in the background") as e:
            c.generate("still nobody?", GREEDY)
        assert e.value.code == "engine_unreachable"
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set():
                if not router.poll(50):
                    continue
                ident, payload = router.recv_multipart()
                if msgspec.msgpack.decode(payload)["type"] == "hello":
                    router.send_multipart([ident, msgspec.msgpack.encode(ready)])

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        try:
            assert c.hello().model == "fake"
            assert c.connected
        finally:
            stop.set()
            t.join()
    router.close(0)
    ctx.term()
