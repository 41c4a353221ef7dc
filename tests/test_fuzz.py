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


def test_hostile_shapes_at_a_tiny_scale(demo_path, tmp_path):
    """Each hostile shape, small, with a victim stream beside it: a documented answer, the
    victim's text untouched, the non-reader cut off, every raced abort ended once (a
    Violation otherwise), and the engine idle with its greedy output unchanged after."""
    from noria.bench.fuzz import run_hostile_session

    results, rc = run_hostile_session(tmp_path / "hostile.log", scale=0.001)
    assert rc == 0
    by_shape = {r.shape: r for r in results}
    assert all(r.victim_unchanged and r.victim_completions >= 1 for r in results), results
    assert by_shape["non_reader"].answer == "aborted by the bridge (slow reader)"
    assert "ended once each" in by_shape["abort_race"].answer
    for shape in ("deep_json", "bad_utf8", "2**64_max_tokens", "2**64_priority"):  # wrong at any size
        assert "400" in by_shape[shape].answer or "error" in by_shape[shape].answer, by_shape[shape]
