"""The bridge against hostile or careless HTTP and websocket clients, on real processes:

* fairness: one client's big batch does not lock another client out (the bridge caps each
  client address in sequences, prompts x n, and its own ZMQ connection is a relay that the
  engine does not cap as one client);
* slow readers: a client that does not read its stream has the stream's requests aborted
  once --stream-buffer bytes wait for it (SSE and websocket), and the engine goes idle;
* slowloris: a request head or body that does not come in time closes the connection, and
  the bridge's open files go back down;
* --max-connections: the connection past the cap is answered 503 at once.

Clients from another address bind a source address of their own on loopback (127.0.0.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from noria.frontend.local_server import wait_http
from noria.protocol.sockets import free_tcp_port
from tests.procs import engine_idle, scrape_metrics, serve_http, wait_metrics

PER_CLIENT = 8
STREAM_BUFFER = 64 << 10


@pytest.fixture(scope="module")
def served(demo_path):
    # The engine's per-connection cap is PER_CLIENT too: the bridge's connection must not be
    # held to it, or one client's batch of PER_CLIENT prompts would fill it for everyone.
    with serve_http("--num-kv-blocks", "1200", "--max-model-len", "2048",
                    "--max-requests-per-connection", str(PER_CLIENT), "--stream-buffer", str(STREAM_BUFFER)) as s:
        yield s


def _session(source: str | None = None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(local_addr=(source, 0) if source else None, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300))


def _body(prompts: list[str] | str, max_tokens: int, **kw) -> dict:
    return {"model": "demo", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}


def test_a_batch_does_not_lock_another_client_out(served):
    url = f"{served.http}/v1/completions"

    async def main() -> None:
        async with _session("127.0.0.1") as a, _session("127.0.0.2") as b:
            # Client A: a batch of PER_CLIENT prompts, its whole budget, streamed so that its
            # first chunk says the batch runs.
            batch = _body([f"batch prompt {i}" for i in range(PER_CLIENT)], 1800, stream=True)
            async with a.post(url, json=batch) as big:
                assert big.status == 200
                await big.content.readline()
                # A reads its stream as it comes: a client that stops reading has its batch
                # aborted as a slow reader (--stream-buffer), which is not what this test is about.
                drain = asyncio.create_task(_drain(big.content))
                # A may not go past its budget: the 429 names the per-client limit.
                async with a.post(url, json=_body("one more", 4)) as over:
                    assert over.status == 429 and int(over.headers["Retry-After"]) >= 1
                    error = (await over.json())["error"]
                    assert error["code"] == "overloaded" and "per-client limit" in error["message"], error
                # Client B, another address, is served while A's batch runs.
                async with b.post(url, json=_body("another client", 4)) as small:
                    assert small.status == 200, await small.text()
                    done = await small.json()
                    assert done["choices"][0]["finish_reason"] == "length"
                m = scrape_metrics(served.http)
                assert m["noria_num_open_requests"] >= PER_CLIENT, "A's batch ended before B was served"
                drain.cancel()
            # A hung up: its batch is aborted and its budget given back.
            async with a.post(url, json=_body("A again", 4)) as again:
                assert again.status == 200, await again.text()

    asyncio.run(main())
    wait_metrics(served.http, engine_idle)


async def _drain(content: aiohttp.StreamReader) -> None:
    while await content.readline():
        pass


def test_one_request_over_the_per_client_cap_is_a_400(served):
    async def main() -> tuple[int, dict]:
        async with _session() as s, s.post(f"{served.http}/v1/completions",
                                           json=_body("x", 4, n=PER_CLIENT + 1)) as r:
            return r.status, await r.json()

    status, body = asyncio.run(main())
    assert status == 400 and body["error"]["param"] == "n" and str(PER_CLIENT) in body["error"]["message"]


def _non_reader(port: int) -> socket.socket:
    """A connected socket with a small receive window, which the test then never reads."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    return s


def _port(http: str) -> int:
    return int(http.rsplit(":", 1)[1])


def _slow_reader_aborts(m: dict[str, float], surface: str) -> float:
    return m.get(f'noria_slow_reader_aborts_total{{surface="{surface}"}}', 0.0)


def _drained_until_closed(s: socket.socket) -> bytes:
    """Everything the server sent before it dropped the connection."""
    s.settimeout(120)  # bounds a hang only: the server has dropped the connection already
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := s.recv(1 << 16):
            got += chunk
    return got


# Many prompts, long outputs and logprobs: megabytes of SSE, far more than the kernel's socket
# buffers and the bridge's --stream-buffer hold.
_FLOOD = _body([f"flood {i}" for i in range(PER_CLIENT)], 1900, stream=True, logprobs=5)


def test_an_sse_client_that_does_not_read_is_aborted(served):
    before = _slow_reader_aborts(scrape_metrics(served.http), "sse")
    s = _non_reader(_port(served.http))
    body = json.dumps(_FLOOD).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    m = wait_metrics(served.http, lambda m: _slow_reader_aborts(m, "sse") > before, timeout=300)
    assert _slow_reader_aborts(m, "sse") == before + 1
    # Aborted upstream long before its 1900 tokens: the engine is idle again.
    m = wait_metrics(served.http, engine_idle)
    assert engine_idle(m)
    got = _drained_until_closed(s)
    s.close()
    assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got


def _ws_frame(payload: bytes) -> bytes:
    """A client's text frame (masked, with a zero mask: the payload goes as it is)."""
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    return head + b"\0\0\0\0" + payload


def test_a_websocket_client_that_does_not_read_is_aborted(served):
    before = _slow_reader_aborts(scrape_metrics(served.http), "websocket")
    s = _non_reader(_port(served.http))
    s.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    for i in range(PER_CLIENT):
        msg = {"type": "generate", "request_id": f"r{i}", "prompt": f"ws flood {i}", "max_tokens": 1900,
               "temperature": 0.0, "ignore_eos": True, "logprobs": 5}
        s.sendall(_ws_frame(json.dumps(msg).encode()))
    m = wait_metrics(served.http, lambda m: _slow_reader_aborts(m, "websocket") > before, timeout=300)
    assert _slow_reader_aborts(m, "websocket") == before + 1
    assert engine_idle(wait_metrics(served.http, engine_idle))
    got = _drained_until_closed(s)
    s.close()
    assert got.startswith(b"HTTP/1.1 101")


@contextlib.contextmanager
def _bridge(engine: str, *flags: str):
    """A standalone `noria bridge` on a free port: (url, its pid)."""
    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", engine,
                             "--port", str(port), *flags])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, proc)
        yield url, proc.pid
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout  # bounds a hang only
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_half_sent_requests_are_closed_after_the_header_and_body_timeouts(served):
    with _bridge(served.address, "--http-header-timeout", "1", "--http-body-timeout", "1") as (url, pid):
        baseline = _open_fds(pid)
        port = _port(url)
        heads = []
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # and never the rest
            heads.append(s)
        for s in heads:
            _drained_until_closed(s)  # returns once the server has closed it (EOF or a reset)
            s.close()
        _wait_for(lambda: _open_fds(pid) <= baseline + 2, "the bridge's open files to go back down")

        # A whole head with part of its body: 408, then the connection is closed.
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        got = _drained_until_closed(s)
        s.close()
        assert got.startswith(b"HTTP/1.1 408") and b"http-body-timeout" in got, got[:300]
        assert scrape_metrics(url)["noria_http_body_timeouts_total"] == 1


def test_the_connection_past_the_cap_is_refused(served):
    cap = 4
    with _bridge(served.address, "--max-connections", str(cap), "--http-header-timeout", "0") as (url, _pid):
        port = _port(url)
        # Each holds a connection: a request head that never ends.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap)]
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        extra = socket.create_connection(("127.0.0.1", port))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _drained_until_closed(extra)
        extra.close()
        assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got, got
        # One held connection closes: there is room again.
        held.pop().close()

        def served_again() -> bool:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = _drained_until_closed(s)
            s.close()
            return answer.startswith(b"HTTP/1.1 200")

        _wait_for(served_again, "a connection to be served once one closed")
        assert scrape_metrics(url)["noria_connections_refused_total"] >= 1
        for s in held:
            s.close()


def test_a_stream_keeps_none_of_what_it_has_sent():
    from noria.frontend.bridge.openai_builders import ChatBuilder, CompletionBuilder
    from noria.protocol.client import Delta, Done, Logprob, Usage

    lp = [Logprob(token_id=5, logprob=-0.5, top_token_ids=[5, 6], top_logprobs=[-0.5, -1.0])]
    for builder in (CompletionBuilder("c", "demo", 0, 2, 1, logprobs=True, stream=True),
                    ChatBuilder("c", "demo", 0, 2, logprobs=True, stream=True)):
        prompts = 2 if isinstance(builder, CompletionBuilder) else 1
        for step in range(100):
            for p in range(prompts):
                chunks = builder.add(p, Delta(request_id="r", text=f"t{step} ", token_ids=[5], index=p % builder.choices.n,
                                              logprobs=lp))
                assert chunks and f"t{step} ".encode() in chunks[0]
        choices = builder.choices
        assert all(not t for t in choices.texts) and all(not lps for lps in choices.logprobs)
        assert all(not o for o in choices.offsets)
        # What the chunks still to come need is kept: text offsets, for logprobs' text_offset.
        assert choices.lengths[0] == sum(len(f"t{s} ") for s in range(100))
        for p in range(prompts):
            builder.add(p, Done(request_id="r", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=100)))
