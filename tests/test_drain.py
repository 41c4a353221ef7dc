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
from tests.faults import mixed_load, worker_stopped, ws_message
from tests.procs import children_of, serve_http, wait_gone
from tests.workers import health, stats, wait_for

PARAMS = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
# The worker may be stopped (tests.faults.worker_stopped) for as long as a busy machine takes.
STOPPABLE = ("--worker-timeout", "120")


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


def _workerless(log, drain: float) -> tuple[LocalServer, list[int]]:
    """A server with no worker at all (its requests wait), up with its bridge."""
    worker_port = free_tcp_port()
    server = LocalServer("--num-local-workers", "0", "--worker-listen", f"tcp://127.0.0.1:{worker_port}",
                         "--drain-timeout", str(drain), log=log)
    server.wait()
    kids = children_of(server.proc.pid)
    wait_for("the bridge", lambda: _bridge_answers(server.http), 60)
    return server, kids


def test_requests_still_open_at_the_drain_timeout_end_with_one_error_each(demo_path, tmp_path):
    drain = 4.0
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server, kids = _workerless(log, drain)
        try:
            prompts = [f"waiting {i}" for i in range(6)]  # no worker: they wait until the drain deadline
            load, got = _in_background(mixed_load, server.address, server.http, prompts, [PARAMS] * 6)
            wait_for("6 open requests", lambda: stats(server.address).num_open_requests == 6, 60)

            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            load.join(120)
            assert not load.is_alive(), "the open requests outlived the drain deadline"

            (streams,) = got
            assert [(s.kind, s.error, s.finals, s.late, s.token_ids) for s in streams] == [
                (kind, "shutting_down", 1, 0, []) for kind in ("zmq", "sse", "ws") * 2]
            assert server.proc.wait(60) == 0
            # Not before the deadline (a slower machine only makes this later).
            assert time.monotonic() - t0 >= drain - 0.5, "the open requests were ended before the drain timeout"
            assert not wait_gone(kids), "orphan processes after the drain"
        finally:
            server.stop()
    text = log_path.read_text(errors="replace")
    assert "draining: 6 open request(s) may finish for 4s" in text
    assert "drain deadline: 6 request(s) ended with shutting_down" in text


def test_a_draining_server_refuses_new_requests_and_keeps_the_open_ones(demo_path, tmp_path):
    """The refusals are checked while the drain lasts: a drain timeout no run reaches, ended
    by Ctrl-C once they are seen (its open requests then end with one error each)."""
    with open(tmp_path / "serve.log", "wb") as log:
        server, kids = _workerless(log, 3600)
        try:
            prompts = [f"waiting {i}" for i in range(3)]
            load, got = _in_background(mixed_load, server.address, server.http, prompts, [PARAMS] * 3)
            wait_for("3 open requests", lambda: stats(server.address).num_open_requests == 3, 60)
            server.proc.send_signal(signal.SIGTERM)
            wait_for("draining", lambda: health(server.http)[1].get("reason") == "draining", 60)
            _refused_everywhere(server.address, server.http)
            assert stats(server.address).num_open_requests == 3, "the drain ended requests it should keep"
            assert load.is_alive()

            server.proc.send_signal(signal.SIGINT)
            load.join(120)
            assert not load.is_alive(), "Ctrl-C did not end the drain"
            (streams,) = got
            assert [(s.kind, s.error, s.finals, s.late, s.token_ids) for s in streams] == [
                (kind, "shutting_down", 1, 0, []) for kind in ("zmq", "sse", "ws")]
            assert server.proc.wait(60) == 0
            assert not wait_gone(kids), "orphan processes after the drain"
        finally:
            server.stop()


def test_sigterm_lets_in_flight_requests_finish(demo_path, tmp_path):
    prompts = [f"Request {i} asks the water wheel" for i in range(6)]
    params = [msgspec.structs.replace(PARAMS, max_tokens=400)] * 6
    log_path = tmp_path / "serve.log"
    # A drain timeout no run reaches: the six must finish, however slowly.
    with log_path.open("w") as err, serve_http("--num-kv-blocks", "256", "--max-num-seqs", "3", "--drain-timeout",
                                               "3600", *STOPPABLE, stderr=err) as served:
        calm = mixed_load(served.address, served.http, prompts, params)
        # The drain begins with all six open: the worker waits until the server holds them and drains.
        with worker_stopped(served.proc.pid):
            load, got = _in_background(mixed_load, served.address, served.http, prompts, params)
            wait_for("6 open requests", lambda: stats(served.address).num_open_requests == 6, 120)
            served.proc.send_signal(signal.SIGTERM)
            wait_for("the drain", lambda: "draining:" in log_path.read_text(), 60)
        load.join(300)
        assert not load.is_alive(), "the drained requests did not finish"
        assert served.proc.wait(60) == 0

        (streams,) = got
        # The server's own count: the drain began with all six open, so each finished in it.
        assert "draining: 6 open request(s) may finish" in log_path.read_text(), "the work must be left to drain"
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
    """One stream each over ZMQ, SSE and the websocket, all open and under way (deltas seen)
    when this returns."""
    progress = [0]
    with worker_stopped(server.proc.pid):
        load, got = _in_background(mixed_load, server.address, server.http, ["a", "b", "c"], [params] * 3, progress)
        wait_for("3 open requests", lambda: stats(server.address).num_open_requests == 3, 120)
    wait_for("3 streams under way", lambda: progress[0] >= 3, 120)
    return load, got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_drains_and_restarts_nothing(demo_path, tmp_path, sig):
    """`timeout 60 noria serve` and Ctrl-C signal the server's whole process group: the children
    are not in it, so SIGTERM lets the streams finish and Ctrl-C ends them with one error each."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        # A drain timeout no run reaches: a Ctrl-C that waited it out would hang past the bounds below.
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "3600", *STOPPABLE, log=log,
                             new_session=True)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            load, got = _start_load(server, msgspec.structs.replace(PARAMS, max_tokens=500))
            with worker_stopped(server.proc.pid):  # the signal lands with all three streams open
                os.killpg(server.proc.pid, sig)
                wait_for("the drain", lambda: "draining:" in log_path.read_text(errors="replace"), 60)
            load.join(300)
            assert not load.is_alive(), "the streams did not end"
            assert server.proc.wait(60) == 0
        finally:
            server.stop()
    (streams,) = got
    assert "draining: 3 open request(s)" in log_path.read_text(errors="replace")
    if sig == signal.SIGTERM:
        assert [(s.error, s.finals, s.late, s.finish_reason) for s in streams] == [(None, 1, 0, "length")] * 3
        assert [len(s.token_ids) for s in streams if s.kind != "sse"] == [500, 500]
    else:
        assert _one_final_each(streams) == [(k, "shutting_down", 1, 0, True) for k in ("zmq", "sse", "ws")]
    assert not _quiet_log(log_path)
    assert not wait_gone(kids), "orphan processes after the drain"


def test_sigterm_to_every_process_ends_the_drain_at_once(demo_path, tmp_path):
    """As systemd's default KillMode=control-group does: the scheduler, the worker and the bridge
    die with the server; nothing is restarted, each stream gets one final error, and the
    server exits 0 long before its drain timeout."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "3600", *STOPPABLE, log=log,
                             new_session=True)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            assert len(kids) == 3  # scheduler, worker rank 0, bridge
            load, got = _start_load(server, LONG)
            for pid in [server.proc.pid, *kids]:  # the server first, as systemd does
                os.kill(pid, signal.SIGTERM)
            load.join(120)
            assert server.proc.wait(60) == 0
        finally:
            server.stop()
    _ended_at_once(load, got, log_path, kids)


def test_a_worker_that_dies_while_the_server_drains_is_not_restarted(demo_path, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = LocalServer("--num-kv-blocks", "256", "--drain-timeout", "3600", *STOPPABLE, log=log)
        try:
            server.wait(http=True)
            kids = children_of(server.proc.pid)
            load, got = _start_load(server, LONG)
            # The worker stops before the drain begins, so the streams are still open when it dies.
            with worker_stopped(server.proc.pid) as worker:
                server.proc.send_signal(signal.SIGTERM)
                wait_for("draining", lambda: health(server.http)[1].get("reason") == "draining", 60)
                os.kill(worker, signal.SIGKILL)
            load.join(120)
            assert server.proc.wait(60) == 0
        finally:
            server.stop()
    _ended_at_once(load, got, log_path, kids)


def _ended_at_once(load: threading.Thread, got: list, log_path, kids: list[int]) -> None:
    """Nothing could finish the open requests: each ended with one `shutting_down`, and the
    server did not wait out its drain timeout (no run reaches it: the bounds above would fail)."""
    assert not load.is_alive(), "the server waited for requests nothing could finish"
    (streams,) = got
    assert _one_final_each(streams) == [(k, "shutting_down", 1, 0, True) for k in ("zmq", "sse", "ws")]
    assert not _quiet_log(log_path)
    assert not wait_gone(kids), "orphan processes after the drain"
