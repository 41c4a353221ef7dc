"""Over the caps, requests are refused as `overloaded` (HTTP 429 with Retry-After, a websocket
error event), and every request that was accepted runs to its end; the engine returns to idle.

A small engine (two sequences at a time) with `--max-queued-requests 6` and
`--max-requests-per-connection 4`, flooded on each surface.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
import websockets
import zmq

from noria.bench.fuzz_drivers import check_engine, reference_output
from tests.faults import worker_stopped
from tests.procs import serve_http

MAX_TOKENS = 24
PROMPT = [1, 17, 42, 99, 7]
FINAL = ("done", "error")


@pytest.fixture(scope="module")
def served(demo_path):
    # --worker-timeout: each flood lands with the worker stopped (tests.faults.worker_stopped),
    # for as long as a busy machine takes to answer the refusals.
    with serve_http("--num-kv-blocks", "64", "--max-model-len", "128", "--max-num-seqs", "2",
                    "--max-queued-requests", "6", "--max-requests-per-connection", "4",
                    "--worker-timeout", "120") as s:
        yield s


def _generate(rid: str) -> dict:
    return {"type": "generate", "request_id": rid, "prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}


def _finals(replies: dict[str, list[dict]]) -> int:
    return sum(m["type"] in FINAL for msgs in replies.values() for m in msgs)


def _zmq_flood(address: str, server_pid: int) -> dict[str, list[dict]]:
    """Raw DEALERs, each sending its 8 requests at once: client 0 first, alone (its fifth and
    later find its per-connection cap of 4), then clients 1-4 together (the engine queue's cap
    of 6 lets two more in). Every reply, by request."""
    ctx = zmq.Context()
    socks = []
    for _ in range(5):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    replies: dict[str, list[dict]] = {}

    def send(c: int) -> None:
        for i in range(8):
            socks[c].send(msgspec.msgpack.encode(_generate(f"z{c}-{i}")))

    def take(finals: int) -> None:
        while _finals(replies) < finals:
            events = dict(poller.poll(120_000))
            assert events, f"no reply within 120 s; {_finals(replies)} of {finals} requests ended"
            for s in events:
                while s.poll(0):
                    m = msgspec.msgpack.decode(s.recv())
                    replies.setdefault(m["request_id"], []).append(m)

    with worker_stopped(server_pid):
        send(0)
        take(4)
        for c in range(1, 5):
            send(c)
        take(4 + 30)
    take(40)
    for s in socks:
        s.close()
    ctx.term()
    return replies


async def _ws_flood(url: str, server_pid: int, n: int) -> dict[str, list[dict]]:
    """`n` requests at once on one websocket; every reply, by request."""
    replies: dict[str, list[dict]] = {}

    async def take(ws: websockets.ClientConnection, finals: int) -> None:
        while _finals(replies) < finals:
            m = json.loads(await asyncio.wait_for(ws.recv(), 120))
            replies.setdefault(m["request_id"], []).append(m)

    async with websockets.connect(url) as ws:
        with worker_stopped(server_pid):
            for i in range(n):
                await ws.send(json.dumps(_generate(f"w{i}")))
            await take(ws, n - 4)
        await take(ws, n)
    return replies


async def _http_flood(url: str, server_pid: int, n: int) -> list[tuple[int, dict, str | None]]:
    """`n` completions at once; the bridge's refusals come back while the worker is stopped."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=240)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one() -> tuple[int, dict, str | None]:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                return r.status, await r.json(), r.headers.get("Retry-After")

        tasks = [asyncio.ensure_future(one()) for _ in range(n)]
        with worker_stopped(server_pid):
            pending = set(tasks)
            while len(pending) > 4:
                done, pending = await asyncio.wait(pending, timeout=120, return_when=asyncio.FIRST_COMPLETED)
                assert done, f"no answer within 120 s; {n - len(pending)} of {n} answered"
        return await asyncio.gather(*tasks)


def _check_zmq_like(replies: dict[str, list[dict]], reference: list[int]) -> tuple[int, int]:
    """(accepted, overloaded); each request ended once, each accepted one with the greedy tokens."""
    accepted = overloaded = 0
    for rid, msgs in replies.items():
        finals = [m for m in msgs if m["type"] in ("done", "error")]
        assert len(finals) == 1 and finals[0] is msgs[-1], (rid, msgs)
        if finals[0]["type"] == "error":
            assert finals[0]["code"] == "overloaded" and len(msgs) == 1, msgs
            overloaded += 1
        else:
            assert finals[0]["finish_reason"] == "length"
            assert [t for m in msgs[:-1] for t in m["token_ids"]] == reference, rid
            accepted += 1
    return accepted, overloaded


def test_flood_beyond_the_caps(served):
    reference = reference_output(served.address, PROMPT, MAX_TOKENS)
    pid = served.proc.pid

    # One surface after the other, each flood sent while the worker is stopped: nothing it lets
    # in can end before its last request is counted, so what is refused is exact, not a race
    # with the engine. The websocket and the HTTP client share one address, so they share its
    # cap of 4 in the bridge.
    zmq_replies = _zmq_flood(served.address, pid)
    ws_replies = asyncio.run(_ws_flood(served.http.replace("http://", "ws://") + "/v1/stream", pid, 10))
    http_answers = asyncio.run(_http_flood(served.http, pid, 12))

    first = {rid: msgs for rid, msgs in zmq_replies.items() if rid.startswith("z0-")}
    rest = {rid: msgs for rid, msgs in zmq_replies.items() if not rid.startswith("z0-")}
    assert len(zmq_replies) == 40 and len(ws_replies) == 10
    assert _check_zmq_like(first, reference) == (4, 4)
    assert _check_zmq_like(rest, reference) == (2, 30)
    assert _check_zmq_like(ws_replies, reference) == (4, 6)
    assert {_refusal(msgs) for msgs in first.values()} == {None, "per-connection limit"}
    assert {_refusal(msgs) for msgs in rest.values()} == {None, "engine queue full"}
    assert {_refusal(msgs) for msgs in ws_replies.values()} == {None, "per-client limit"}

    statuses = sorted(s for s, _, _ in http_answers)
    assert statuses == [200] * 4 + [429] * 8, statuses
    for status, body, retry_after in http_answers:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "rate_limit_error"
            assert "per-client limit" in body["error"]["message"]
        else:
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
    check_engine(served.address, PROMPT, reference)


def _refusal(msgs: list[dict]) -> str | None:
    """Which cap refused the request (the start of its message), None if it was taken."""
    final = msgs[-1]
    if final["type"] != "error":
        return None
    for cap in ("per-connection limit", "engine queue full", "per-client limit"):
        if cap in final["message"]:
            return cap
    return final["message"]


def test_a_frame_over_the_size_limit_is_dropped_with_its_connection(served):
    from noria.protocol.sockets import MAX_CLIENT_MESSAGE

    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(served.address)
    big.send(msgspec.msgpack.encode({"type": "generate", "request_id": "big", "prompt": "x" * MAX_CLIENT_MESSAGE}))
    # Without the limit the server would read the frame and answer (prompt_too_long) at once.
    assert not big.poll(3000)
    big.close()
    ctx.term()
    check_engine(served.address, PROMPT, reference_output(served.address, PROMPT, MAX_TOKENS))
