"""Bad input on every surface of one real `noria serve` (hypothesis; `noria bench fuzz` is the long run).

After each input the server must be alive and answer with a documented error or
a normal reply within a bound; every 500 inputs and after each surface the
engine must be idle with no KV block in use and its block check consistent, and
a greedy request must give the tokens it gave before the first input. The
server's log must hold no traceback and it must exit 0 on Ctrl-C.
"""

from __future__ import annotations

import pytest

from noria.bench.fuzz import FuzzSession


@pytest.fixture(scope="module")
def fuzz(demo_path, tmp_path_factory):
    session = FuzzSession(tmp_path_factory.mktemp("fuzz") / "server.log", check_every=500)
    try:
        yield session
    finally:
        assert session.close() == 0  # also raises if the log shows a traceback


@pytest.mark.parametrize(("surface", "n"), [("zmq", 1000), ("zmq_bytes", 1000), ("ws", 1000), ("http", 1000),
                                             ("http_raw", 300)])
def test_fuzz_surface(fuzz, surface, n):
    fuzz.run(surface, n)
    counts = fuzz.counts[surface]
    assert counts["inputs"] >= n
    if surface in ("zmq", "ws"):
        # The fuzzer also sends good requests: some must have run to the end.
        assert counts["done:length"] + counts["done:stop"] > 0 and counts["invalid_message"] > 0
    if surface == "http":
        assert counts["200"] > 0 and counts["400"] > 0
