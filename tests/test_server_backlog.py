"""The frontend server prepares a large `generate` off its I/O loop: the loop keeps answering
(`hello`, other clients), and each client's messages still take effect in the order sent (an
`abort` behind its request being prepared finds it). A stub core stands in for the engine:
these are the server's own rules, checked without timing."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import zmq

from noria.frontend.core import Prepared
from noria.frontend.server import LARGE_REQUEST, FrontendServer
from noria.protocol.client import Abort, Generate, Hello
from tests.workers import wait_for


class StubCore:
    """Records what the server applies; `prepare` waits for the test to let it go."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str, bool]] = []  # (what, request_id, prepared off the loop)
        self.release = threading.Event()
        self.preparing = threading.Event()
        self.engine = SimpleNamespace(ready=SimpleNamespace(max_model_len=64, vocab_size=64))

    def prepare(self, msg: Generate) -> Prepared:
        self.preparing.set()
        assert self.release.wait(30), "the test never released the preparation"
        return Prepared([1], msg.sampling_params(), None, None)  # type: ignore[arg-type]

    def submit(self, key, msg, sink, stream=True, client=None, prepared=None) -> None:  # noqa: ANN001
        self.applied.append(("generate", msg.request_id, prepared is not None))

    def abort(self, key) -> None:  # noqa: ANN001
        self.applied.append(("abort", key[1], False))

    def abort_where(self, pred) -> int:  # noqa: ANN001
        return 0


def _server() -> tuple[FrontendServer, StubCore]:
    core = StubCore()
    server = FrontendServer(core, "tcp://127.0.0.1:*", "demo")  # type: ignore[arg-type]
    return server, core


def test_a_large_request_is_prepared_off_the_loop_and_its_clients_order_holds():
    server, core = _server()
    try:
        big = Generate(request_id="big", prompt="x", stop=["s" * 200] * (LARGE_REQUEST // 200 + 1))
        size = len(server.codec.encode(big))
        assert size > LARGE_REQUEST
        a, b = b"client-a", b"client-b"
        server._dispatch(a, big, size)
        assert core.preparing.wait(30)
        # While it is prepared: the same client's abort and next request wait behind it ...
        server._dispatch(a, Abort(request_id="big"))
        server._dispatch(a, Generate(request_id="next", prompt="y"), 10)
        # ... another client's request and any hello are served at once.
        server._dispatch(b, Generate(request_id="other", prompt="z"), 10)
        server._dispatch(a, Hello())
        assert core.applied == [("generate", "other", False)]
        core.release.set()
        wait_for("the prepared request", lambda: _woken(server), 30)
        assert core.applied == [("generate", "other", False), ("generate", "big", True), ("abort", "big", False),
                                ("generate", "next", False)]
        assert not server.backlog
    finally:
        core.release.set()
        server.close()


def _woken(server: FrontendServer) -> bool:
    poller = zmq.Poller()
    poller.register(server.wake_r, zmq.POLLIN)
    if not poller.poll(0):
        return False
    server._on_wake()
    return True


def test_a_client_that_vanishes_leaves_no_backlog():
    server, core = _server()
    try:
        big = Generate(request_id="big", prompt="x")
        server._dispatch(b"gone", big, LARGE_REQUEST + 1)
        server._dispatch(b"gone", Generate(request_id="after", prompt="y"), 10)
        assert core.preparing.wait(30)
        server.gone.add(b"gone")
        server._abort_gone()
        core.release.set()
        wait_for("the preparation to end", lambda: _woken(server), 30)
        assert core.applied == [] and not server.backlog
    finally:
        core.release.set()
        server.close()
