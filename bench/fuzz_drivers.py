"""Send one fuzzed input to a running `noria serve` and check the answer, per surface.

Every `exchange` waits, within a bound, until the server has no request open
(and the surface's own sentinel has come back), and raises `Violation` when an
answer is not a documented one: an undecodable reply, an undocumented error
code, a 5xx, a request that never ends, a closed websocket. The engine-wide
invariants (KV blocks back to 0 and consistent, greedy output unchanged) are
`check_engine`'s.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter
from typing import Any

import msgspec
import zmq

from noria.protocol.client import Done, Error, GetStats, ServerToClient, Stats

# Codes the server may answer a client with (docs/protocol.md); anything else is a bug.
DOCUMENTED = {"invalid_message", "invalid_request", "prompt_too_long", "duplicate_request", "overloaded"}
HTTP_OK = {200, 400, 401, 404, 405, 409, 413, 429}


class Violation(AssertionError):
    """An answer the protocol does not allow."""


class ZmqProbe:
    """A raw pyzmq DEALER: sends frames as they are and reads every reply back."""

    def __init__(self, address: str, timeout: float = 60.0) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout = timeout
        self.decoder = msgspec.msgpack.Decoder(ServerToClient)
        self.stats_query = msgspec.msgpack.encode(GetStats())

    def exchange(self, frames: list[bytes]) -> Counter[str]:
        for f in frames:
            self.sock.send(f)
        return self.settle()

    def settle(self) -> Counter[str]:
        """Read replies until the server reports no open request; count them by kind and code."""
        codes: Counter[str] = Counter()
        deadline = time.monotonic() + self.timeout
        self.sock.send(self.stats_query)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise Violation(f"no idle server within {self.timeout}s (answers so far: {dict(codes)})")
            raw = self.sock.recv()
            try:
                msg = self.decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise Violation(f"undecodable reply {raw[:200]!r}: {e}") from None
            if isinstance(msg, Error):
                if msg.code not in DOCUMENTED:
                    raise Violation(f"undocumented error {msg.code}: {msg.message}")
                codes[msg.code] += 1
            elif isinstance(msg, Done):
                codes[f"done:{msg.finish_reason}"] += 1
            elif isinstance(msg, Stats):
                if msg.num_open_requests == 0:
                    return codes
                self.sock.poll(20)  # requests still run: ask again soon (the deadline bounds this)
                self.sock.send(self.stats_query)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class WsProbe:
    """A `websockets` client on /v1/stream; a sentinel request marks the end of each exchange."""

    def __init__(self, url: str, zmq_probe: ZmqProbe, timeout: float = 60.0) -> None:
        from websockets.sync.client import connect

        self.url, self.timeout, self.zmq = url, timeout, zmq_probe
        # No keepalive pings: their random payload, drawn in a background thread, would disturb
        # hypothesis's control of the global random state (and each exchange is bounded anyway).
        self._connection = connect(url, max_size=None, open_timeout=timeout, ping_interval=None)
        self.ws = self._connection.__enter__()
        self.count = 0

    def exchange(self, message: str | bytes) -> Counter[str]:
        """Send `message`, then a sentinel request; read until both it and every request
        that streamed have ended, then until the frontend holds no open request."""
        self.sent = message
        self.ws.send(message)
        codes = self._sentinel()
        self.zmq.settle()  # requests that never streamed have ended too
        return codes + self._sentinel()

    def _sentinel(self) -> Counter[str]:
        from websockets.exceptions import ConnectionClosed

        self.count += 1
        sentinel = f"__sentinel{self.count}"
        self.ws.send(json.dumps({"type": "generate", "request_id": sentinel, "prompt_token_ids": [1], "max_tokens": 1}))
        codes: Counter[str] = Counter()
        open_rids: set[str] = set()
        seen: list[dict[str, Any]] = []
        sentinel_back = False
        deadline = time.monotonic() + self.timeout
        while not sentinel_back or open_rids:
            try:
                raw = self.ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise Violation(f"requests did not end within {self.timeout}s: {sorted(open_rids)[:5]}, sentinel "
                                f"back: {sentinel_back}; sent {self.sent[:300]!r}, answers {str(seen)[:1000]}") from None
            except ConnectionClosed as e:
                raise Violation(f"the server closed the websocket: {e}; sent {self.sent[:300]!r}") from None
            msg = _json_reply(raw)
            seen.append(msg)
            rid, kind = msg.get("request_id"), msg["type"]
            if kind == "delta":
                open_rids.add(rid)
                continue
            open_rids.discard(rid)
            sentinel_back = sentinel_back or rid == sentinel
            if rid != sentinel:
                codes[msg["code"] if kind == "error" else f"done:{msg['finish_reason']}"] += 1
        return codes

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


def _json_reply(raw: str | bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw)
    except ValueError:
        raise Violation(f"a websocket reply that is not JSON: {raw[:200]!r}") from None
    if not isinstance(msg, dict) or msg.get("type") not in ("delta", "done", "error"):
        raise Violation(f"an undocumented websocket reply: {str(msg)[:200]}")
    if msg["type"] == "error" and msg.get("code") not in DOCUMENTED:
        raise Violation(f"undocumented error {msg.get('code')}: {msg.get('message')}")
    return msg


def http_exchange(host: str, port: int, method: str, path: str, headers: dict[str, str], body: bytes,
                  timeout: float = 60.0) -> int:
    """One request on a fresh connection; the status, after checking the body's shape."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body if method not in ("GET", "HEAD") else None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    except TimeoutError:
        raise Violation(f"{method} {path}: no complete answer within {timeout}s") from None
    finally:
        conn.close()
    if resp.status not in HTTP_OK:
        raise Violation(f"{method} {path} -> {resp.status}: {data[:300]!r}")
    if resp.status >= 400 and method != "HEAD":
        try:
            err = json.loads(data)["error"]
            assert isinstance(err["message"], str) and "type" in err
        except (ValueError, KeyError, TypeError, AssertionError):
            raise Violation(f"{method} {path} -> {resp.status} without OpenAI's error shape: {data[:300]!r}") from None
    stream = resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    if stream and path.startswith("/v1/messages"):  # Anthropic's events: message_stop, or an error event
        last = data.rstrip().rsplit(b"\n\n", 1)[-1]
        if not (last.startswith(b"event: message_stop\n") or last.startswith(b"event: error\n")):
            raise Violation(f"{method} {path}: an event stream that ends with neither message_stop nor error: "
                            f"{data[-200:]!r}")
    elif stream and not data.rstrip().endswith(b"data: [DONE]"):
        raise Violation(f"{method} {path}: an event stream that does not end with [DONE]: {data[-200:]!r}")
    return resp.status


def raw_http_exchange(host: str, port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Bytes on a raw TCP connection, write side closed; the answer's status line (or b'')."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the server closed first: a fine answer to garbage
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            raise Violation(f"the connection stayed open {timeout}s after {data[:80]!r}") from None
        except ConnectionResetError:
            pass
    answer = b"".join(chunks)
    status = answer.split(b"\r\n", 1)[0]
    if status and not status.startswith(b"HTTP/1."):
        raise Violation(f"not an HTTP answer: {status[:100]!r}")
    if status[9:10] == b"5":
        raise Violation(f"{status!r} for {data[:80]!r}")
    return status


def check_engine(address: str, prompt_ids: list[int], reference: list[int], timeout: float = 60.0) -> None:
    """KV usage back to 0, the idle block check consistent, and a greedy request as at the start."""
    from noria.frontend.client import Client

    with Client(address, timeout=timeout) as c:
        deadline = time.monotonic() + timeout
        while True:
            s = c.stats()
            st = s.stats
            idle = s.num_open_requests == 0 and st.num_running == 0 and st.num_waiting == 0 and st.num_swapped == 0
            if idle and st.kv_cache_usage == 0 and st.num_free_blocks == st.num_kv_blocks and st.blocks_consistent:
                break
            if time.monotonic() > deadline:
                raise Violation(f"the engine did not come back to idle with no KV in use: {st}")
            time.sleep(0.05)  # poll interval; the deadline bounds it
        out = c.generate(prompt_ids, greedy(len(reference))).outputs[0].token_ids
    if out != reference:
        raise Violation(f"greedy output changed: {out} != {reference}")


def greedy(max_tokens: int = 12) -> Any:
    from noria.protocol.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def reference_output(address: str, prompt_ids: list[int], max_tokens: int = 12) -> list[int]:
    from noria.frontend.client import Client

    with Client(address, timeout=60.0) as c:
        return c.generate(prompt_ids, greedy(max_tokens)).outputs[0].token_ids
