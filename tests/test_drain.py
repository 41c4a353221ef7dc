"""SIGTERM drains `noria serve`: /health says 503 "draining", new requests are refused
(ZMQ `shutting_down`, HTTP 503, a websocket error event), open requests finish, and those
still open at --drain-timeout end with exactly one `shutting_down` error each; the server
then exits 0 and leaves no process behind.

Requests that cannot finish come from a server with no worker at all (`--num-local-workers
0`): they wait, so the drain deadline is what ends them, whatever the machine's speed.

A signal to the server's whole process group (`timeout`, Ctrl-C in a terminal) reaches the
server alone; one sent to every process of it (systemd's KillMode=control-group), or a child
that dies while the server drains, restarts nothing: the open requests end at once with one
`shutting_down` error each and the server exits 0 without waiting out --drain-timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import websockets

from noria import Client, NoriaError, SamplingParams
from noria.frontend.local_server import LocalServer
from noria.protocol.sockets import free_tcp_port
from tests.faults import kill_named, mixed_load, ws_message
from tests.procs import children_of, serve_http, wait_gone
from tests.workers import health, stats, wait_for

PARAMS = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


def _post(http: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _bridge_answers(http: str) -> bool:
    """The bridge is up (its /health is 503 without a worker, but it answers)."""
    try:
        return _post(http, {})[0] == 400  # an empty body
    except OSError:
        return False


async def _ws_one(http: str, prompt: str) -> dict:
    async with websockets.connect(http.replace("http://", "ws://") + "/v1/stream") as ws:
        await ws.send(ws_message("late", prompt, PARAMS))
        return msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))


def _in_background(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def _refused_everywhere(address: str, http: str) -> None:
    """A draining server: health 503 "draining", and a new request of every kind refused."""
    status, body = health(http)
    assert (status, body["reason"]) == (503, "draining")
    with Client(address, timeout=30) as c, pytest.raises(NoriaError) as e:
        c.generate("too late", PARAMS)
    assert e.value.code == "shutting_down"
    status, body = _post(http, {"model": "demo", "prompt": "too late", "max_tokens": 4})
    assert status == 503 and body["error"]["code"] == "shutting_down"
    m = asyncio.run(_ws_one(http, "too late"))
    assert (m["type"], m["request_id"], m["code"]) == ("error", "late", "shutting_down")


def test_requests_still_open_at_the_drain_timeout_end_with_one_error_each(demo_path):
    drain = 4.0
    worker_port = free_tcp_port()
    server = LocalServer("--num-local-workers", "0", "--worker-listen", f"tcp://127.0.0.1:{worker_port}",
                         "--drain-timeout", str(drain))
    try:
        server.wait()
        kids = children_of(server.proc.pid)
        wait_for("the bridge", lambda: _bridge_answers(server.http), 60)
        prompts = [f"waiting {i}" for i in range(6)]  # no worker: they wait until the drain deadline
        load, got = _in_background(mixed_load, server.address, server.http, prompts, [PARAMS] * 6)
        wait_for("6 open requests", lambda: stats(server.address).num_open_requests == 6, 30)

        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        wait_for("draining", lambda: health(server.http)[1].get("reason") == "draining", 10)
        _refused_everywhere(server.address, server.http)
        load.join(60)

        (streams,) = got
        assert [(s.kind, s.error, s.finals, s.late, s.token_ids) for s in streams] == [
            (kind, "shutting_down", 1, 0, []) for kind in ("zmq", "sse", "ws") * 2]
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 >= drain - 0.5, "the open requests were ended before the drain timeout"
        assert not wait_gone(kids), "orphan processes after the drain"
    finally:
        server.stop()


def test_sigterm_lets_in_flight_requests_finish(demo_path):
    prompts = [f"Request {i} asks the water wheel" for i in range(6)]
    params = [msgspec.structs.replace(PARAMS, max_tokens=400)] * 6  # long enough for all six to be open at once
    with serve_http("--num-kv-blocks", "256", "--max-num-seqs", "3") as served:
        calm = mixed_load(served.address, served.http, prompts, params)
        progress: list[int] = [0]
        load, got = _in_background(mixed_load, served.address, served.http, prompts, params, progress)
        wait_for("6 open requests", lambda: stats(served.address).num_open_requests == 6, 60)
        at_term = progress[0]
        served.proc.send_signal(signal.SIGTERM)
        load.join(120)
        assert served.proc.wait(60) == 0

        (streams,) = got
        assert at_term < 6 * 400 // 2, "most of the work must be left to drain"
        assert [(s.error, s.finals, s.late, s.finish_reason) for s in streams] == [(None, 1, 0, "length")] * 6
        assert [s.text for s in streams] == [s.text for s in calm]
        assert [s.token_ids for s in streams] == [s.token_ids for s in calm]


LONG = msgspec.structs.replace(PARAMS, max_tokens=1900)  # the demo model's 2048 positions: cannot finish in time


def _quiet_log(path) -> list[str]:
    """Log lines that must not be there after a stop: a restart of anything, a traceback."""
    text = path.read_text(errors="replace")
    return [line for line in text.splitlines() if "restart" in line.lower() or "Traceback" in line]


def _one_final_each(streams) -> list[tuple]:
    """(kind, error, finals, late, one final): an SSE stream's final is its finish_reason or its error."""
    return [(s.kind, s.error, s.finals, s.late, (s.error is None) != (s.finish_reason is None)) for s in streams]


def _start_load(server: LocalServer, params: SamplingParams) -> tuple[threading.Thread, list]:
    """One stream each over ZMQ, SSE and the websocket, under way (a delta seen) when this returns."""
    progress = [0]
    load, got = _in_background(mixed_load, server.address, server.http, ["a", "b", "c"], [params] * 3, progress)
    wait_for("3 streams under way", lambda: stats(server.address).num_open_requests == 3 and progress[0] >= 3, 60)
    return load, got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_drains_and_restarts_nothing(demo_path, tmp_path, sig):
    """`timeout 60 noria serve` and Ctrl-C signal the server's whole process group: the children
    are not in it, so SIGTERM lets the streams finish and Ctrl-C ends them with one error each."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "60", log=log, new_session=True)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            load, got = _start_load(server, msgspec.structs.replace(PARAMS, max_tokens=500))
            t0 = time.monotonic()
            os.killpg(server.proc.pid, sig)
            load.join(120)
            assert server.proc.wait(60) == 0
            elapsed = time.monotonic() - t0
        finally:
            server.stop()
    (streams,) = got
    if sig == signal.SIGTERM:
        assert [(s.error, s.finals, s.late, s.finish_reason) for s in streams] == [(None, 1, 0, "length")] * 3
        assert [len(s.token_ids) for s in streams if s.kind != "sse"] == [500, 500]
    else:
        assert _one_final_each(streams) == [(k, "shutting_down", 1, 0, True) for k in ("zmq", "sse", "ws")]
        assert elapsed < 30, f"Ctrl-C took {elapsed:.1f}s"
    assert not _quiet_log(log_path)
    assert not wait_gone(kids), "orphan processes after the drain"


def test_sigterm_to_every_process_ends_the_drain_at_once(demo_path, tmp_path):
    """As systemd's default KillMode=control-group does: the scheduler, the worker and the bridge
    die with the server; nothing is restarted, each stream gets one final error, and the
    server exits 0 long before its drain timeout."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "60", log=log, new_session=True)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            assert len(kids) == 3  # scheduler, worker rank 0, bridge
            load, got = _start_load(server, LONG)
            t0 = time.monotonic()
            for pid in [server.proc.pid, *kids]:  # the server first, as systemd does
                os.kill(pid, signal.SIGTERM)
            load.join(60)
            assert server.proc.wait(60) == 0
            elapsed = time.monotonic() - t0
        finally:
            server.stop()
    _ended_at_once(got, elapsed, log_path, kids)


def test_a_worker_that_dies_while_the_server_drains_is_not_restarted(demo_path, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "60", log=log)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            load, got = _start_load(server, LONG)
            server.proc.send_signal(signal.SIGTERM)
            wait_for("draining", lambda: health(server.http)[1].get("reason") == "draining", 10)
            t0 = time.monotonic()
            kill_named(server.proc.pid, b"noria.worker")
            load.join(60)
            assert server.proc.wait(60) == 0
            elapsed = time.monotonic() - t0
        finally:
            server.stop()
    _ended_at_once(got, elapsed, log_path, kids)


def _ended_at_once(got: list, elapsed: float, log_path, kids: list[int]) -> None:
    """Nothing could finish the open requests: each ended at once with one `shutting_down`."""
    (streams,) = got
    assert _one_final_each(streams) == [(k, "shutting_down", 1, 0, True) for k in ("zmq", "sse", "ws")]
    assert elapsed < 20, f"the server waited {elapsed:.1f}s for requests nothing could finish"
    assert not _quiet_log(log_path)
    assert not wait_gone(kids), "orphan processes after the drain"
