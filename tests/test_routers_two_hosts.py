"""vllm-router over two hosts (tests/netns.py: this namespace as host A, a new one as host B): an
engine on each, the router on A reaching B's engine over the veth for requests and for its
KV-cache events. kv_aware finds a prefix on whichever host computed it; round-robin uses both."""

from __future__ import annotations

import random
import sys
import time
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest

from noria.frontend.local_server import LocalServer
from noria.protocol.sockets import free_tcp_port
from tests import netns
from tests.test_routers import _complete, _hits, _idle, _prefix, _served, router

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"no network namespaces: {netns.unavailable()}")

FLAGS = ["--num-kv-blocks", "256", "--max-model-len", "1024"]


class _Remote:
    """What the router tests read of an engine: its bridge's address and its events' endpoint."""

    def __init__(self, http: str, events: str) -> None:
        self.http, self.events = http, events


def _events(port: int) -> str:
    return msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}).decode()


def _wait_health(http: str, proc) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"host B's server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{http}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "host B's server did not come up"
        time.sleep(0.2)  # poll interval; the deadline bounds the wait


@pytest.fixture(scope="module")
def engines(demo_path) -> Iterator[list]:
    with netns.two_hosts() as hosts:
        # Host B is a fresh namespace: any port is free there.
        port, zmq_port, events = 18080, 15555, 15557
        b = hosts.popen_on_b([sys.executable, "-m", "noria.frontend.cli", "serve", "--host", "0.0.0.0", "--port", str(port), "--zmq-port", str(zmq_port), *FLAGS,
                              "--kv-events-config", _events(events)])
        a_events = free_tcp_port()
        a = LocalServer(*FLAGS, "--kv-events-config", _events(a_events))  # both serve "demo" (demo_path's)
        try:
            a.wait(http=True)
            remote = _Remote(f"http://{hosts.addr_b}:{port}", f"tcp://{hosts.addr_b}:{events}")
            _wait_health(remote.http, b)
            local = _Remote(a.http, f"tcp://127.0.0.1:{a_events}")
            yield [local, remote]
        finally:
            a.stop()
            b.send_signal(2)  # Ctrl-C: the server drains and stops its children
            b.wait(timeout=60)


def test_round_robin_uses_both_hosts(engines):
    before = [_served(e) for e in engines]
    with router(engines, "round_robin") as url:  # type: ignore[arg-type]
        for i in range(4):
            assert _complete(url, f"across hosts {i}")["usage"]["completion_tokens"] == 4
    _idle(engines)  # type: ignore[arg-type]
    assert [_served(e) - b for e, b in zip(engines, before, strict=True)] == [2, 2]


def test_kv_aware_finds_a_prefix_on_either_host(engines):
    rng = random.Random(3)
    sources = [arg for e in engines for arg in ("--kv-event-source", f"{e.http}={e.events}")]
    tries = 0
    with router(engines, "kv_aware", *sources, "--kv-event-block-size", "16",  # type: ignore[arg-type]
                "--kv-event-model", "demo") as url:
        for k in range(4):
            owner, prefix = engines[k % 2], _prefix(rng)
            seeded = _complete(owner.http, f"{prefix} question 0:")["usage"]["prompt_tokens"]
            before = _hits(owner)
            deadline = time.monotonic() + 60
            while _hits(owner) - before < seeded // 2:
                assert time.monotonic() < deadline, f"prefix {k} never routed to host {'AB'[k % 2]}"
                _complete(url, f"{prefix} question {rng.random()}:")
                _idle(engines)  # type: ignore[arg-type]
                tries += 1
    # The events cross the veth before the seeding answer does: nearly every first try lands.
    assert tries <= 4 + 2, tries
