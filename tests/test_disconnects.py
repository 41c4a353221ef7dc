"""Clients that vanish mid-stream (ZMQ DEALERs closed, websockets and SSE connections cut),
mixed with well-behaved ones: every orphan is aborted within a bound, KV usage returns to 0,
and the others' greedy outputs are unchanged; the engine made far fewer tokens than the
orphans asked for. 500 vanishing clients, as `noria bench disconnects` runs by default.
"""

from __future__ import annotations

import asyncio

from noria.bench.disconnects import SERVER_FLAGS, storm
from tests.procs import serve_http


def test_a_disconnect_storm_leaves_nothing_behind(demo_path):
    with serve_http(*SERVER_FLAGS) as s:
        report = asyncio.run(storm(s.address, s.http, clients=500, keepers=3, abort_bound=60.0))
    assert report["clients"] == 500 and report["orphans_aborted_within_s"] <= 60.0
    assert report["tokens_generated"] < report["tokens_if_not_aborted"] // 2
