"""Hostile request shapes against one `noria serve`, each with a victim stream running beside it.

The fuzzer (bench/fuzz.py) draws many small bad inputs; these are the few big ones an
attacker would pick: huge lists (stop strings, bad_words, logit_bias, messages), integers
past 64 bits, a huge role, a batch that asks for a client's whole budget many times over,
abort races, a client that does not read its stream, deeply nested JSON and bytes that
are not UTF-8. While each runs, a victim (another client address, 127.0.0.2) streams
greedy completions through the bridge, one after the other. Per shape the report gives
the answer (HTTP status and error, or the final messages), the victim's largest gap
between two chunks, and whether every victim completion was the text it is alone.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from noria.bench.fuzz_drivers import Violation

# An engine with room for long victims and a small --stream-buffer, so that a non-reader
# is cut off after megabytes, not tens of them.
SERVER_FLAGS = ("--max-model-len", "512", "--num-kv-blocks", "800", "--max-num-seqs", "64",
                "--stream-buffer", str(256 << 10))
VICTIM_PROMPT = [1, 17, 42, 99, 7]
VICTIM_TOKENS = 64
VICTIM_SOURCE = "127.0.0.2"  # another client address than the attacker's
BIG = 2**64


@dataclass
class ShapeResult:
    shape: str
    answer: str  # what the attacker got: status and error, or its final messages counted
    victim_max_gap_ms: float  # the largest gap between two chunks of one victim completion
    victim_unchanged: bool  # every victim completion had the text it has alone
    victim_completions: int
    seconds: float


class Victim:
    """Streams greedy completions, one after the other, until stopped (a thread)."""

    def __init__(self, host: str, port: int, reference: str | None = None) -> None:
        self.host, self.port = host, port
        self.reference = reference
        self.max_gap = 0.0
        self.completions = 0
        self.texts: list[str] = []
        self.errors: list[str] = []
        self.streaming = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def one(self) -> str:
        """One streamed completion; its text. Records the largest gap between chunks."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300, source_address=(VICTIM_SOURCE, 0))
        body = json.dumps({"model": "demo", "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0.0,
                           "ignore_eos": True, "stream": True})
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise Violation(f"victim got {resp.status}: {resp.read()[:200]!r}")
            text, last = [], None
            while line := resp.readline():
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise Violation(f"victim's stream ended with an error: {chunk['error']}")
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                if last is not None:
                    self.max_gap = max(self.max_gap, now - last)
                last = now
                self.streaming.set()
            return "".join(text)
        finally:
            conn.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                text = self.one()
            except (OSError, Violation, ValueError) as e:
                self.errors.append(str(e)[:200])
                self.streaming.set()
                return
            self.completions += 1
            self.texts.append(text)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="victim", daemon=True)
        self._thread.start()
        if not self.streaming.wait(120):
            raise Violation("the victim's stream did not start within 120 s")

    def stop(self) -> None:
        """Let the completion under way finish (the one that saw the shape end), then stop."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(600)

    @property
    def unchanged(self) -> bool:
        return not self.errors and bool(self.texts) and all(t == self.reference for t in self.texts)


def _http(host: str, port: int, method: str, path: str, body: bytes, timeout: float = 300.0,
          content_type: str = "application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _answer(status: int, data: bytes) -> str:
    """'STATUS code: message' (shortened) for an error, 'STATUS finish_reason' for a completion."""
    try:
        doc = json.loads(data)
    except ValueError:
        return f"{status} {data[:80]!r}"
    if isinstance(doc, dict) and doc.get("error"):  # a Response object holds `"error": null`
        err = doc["error"]
        return f"{status} {err.get('code') or err.get('type')}: {str(err.get('message'))[:90]}"
    if isinstance(doc, dict) and doc.get("choices"):
        return f"{status} {doc['choices'][0].get('finish_reason')}"
    if isinstance(doc, dict) and doc.get("type") == "message":  # Anthropic's
        return f"{status} {doc.get('stop_reason')}"
    if isinstance(doc, dict) and doc.get("object") == "response":
        return f"{status} {doc.get('status')}"
    return f"{status}"


Action = Callable[[], str]  # sends a prepared shape; what it got, in a few words


class Attacker:
    """The shapes. Each method prepares its bytes (which may take this process a while: not
    while the victim is timed) and returns the action that sends them."""

    def __init__(self, host: str, port: int, scale: float) -> None:
        self.host, self.port, self.scale = host, port, scale

    def n(self, full: int) -> int:
        return max(2, int(full * self.scale))

    def post(self, path: str, body: bytes) -> Action:
        return lambda: _answer(*_http(self.host, self.port, "POST", path, body))

    def completion(self, **fields: Any) -> Action:
        doc = {"model": "demo", "prompt": "hello", "max_tokens": 4, **fields}
        return self.post("/v1/completions", json.dumps(doc).encode())

    def chat(self, messages: Any, **fields: Any) -> Action:
        doc = {"model": "demo", "messages": messages, "max_tokens": 4, **fields}
        return self.post("/v1/chat/completions", json.dumps(doc).encode())

    # ---- the shapes --------------------------------------------------------

    def stop_strings(self) -> Action:
        return self.completion(stop=[f"s{i}" for i in range(self.n(100_000))])

    def bad_words(self) -> Action:
        return self.ws_final({"bad_words": [f"w{i}" for i in range(self.n(100_000))]})

    def logit_bias(self) -> Action:
        return self.completion(logit_bias={str(i): 1.0 for i in range(self.n(100_000))})

    def messages(self) -> Action:
        return self.chat([{"role": "user", "content": "hi"}] * self.n(100_000))

    def responses_items(self) -> Action:
        """/v1/responses with a huge list of input items: messages, tool calls and their outputs."""
        items = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} if i % 3 == 1 else
                 {"type": "function_call_output", "call_id": f"c{i - 1}", "output": "ok"} if i % 3 == 2 else
                 {"role": "user", "content": [{"type": "input_text", "text": "hi"}]} for i in range(self.n(100_000))]
        doc = {"model": "demo", "input": items, "max_output_tokens": 4}
        return self.post("/v1/responses", json.dumps(doc).encode())

    def huge_role(self) -> Action:
        return self.chat([{"role": "r" * self.n(8 << 20), "content": "hi"}])

    def anthropic_blocks(self) -> Action:
        """/v1/messages with a huge conversation of content blocks: tool calls and their results."""
        turns = [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {"a": i}}]}
                 if i % 2 else {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i - 1}",
                                                            "content": "ok"}, {"type": "text", "text": "hi"}]}
                 for i in range(self.n(100_000))]
        doc = {"model": "demo", "max_tokens": 4, "messages": turns + [{"role": "user", "content": "hi"}]}
        return self.post("/v1/messages", json.dumps(doc).encode())

    def big_int(self, field: str) -> Callable[[], Action]:
        def prepare() -> Action:
            http, ws = self.completion(**{field: BIG}), self.ws_final({field: BIG})
            return lambda: f"http {http()}; ws {ws()}"
        return prepare

    def batches(self) -> Action:
        """Eight requests of 128 prompts at once from one address: its whole budget by default."""
        prompts = [f"batch {i}" for i in range(self.n(128))]
        body = json.dumps({"model": "demo", "prompt": prompts, "max_tokens": 16, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        def act() -> str:
            results: list[str] = []

            def one() -> None:
                status, data = _http(self.host, self.port, "POST", "/v1/completions", body)
                results.append(_answer(status, data).split(":")[0])

            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            return ", ".join(f"{k} x{v}" for k, v in sorted(Counter(results).items()))

        return act

    def abort_race(self) -> Action:
        """Websocket generates, each aborted at once; every one must end exactly once."""
        count = self.n(200)
        frames = [json.dumps(m) for i in range(count)
                  for m in ({"type": "generate", "request_id": f"a{i}", "prompt": "race", "max_tokens": 200,
                             "ignore_eos": True}, {"type": "abort", "request_id": f"a{i}"})]
        return lambda: self._race(frames, count)

    def _race(self, frames: list[str], count: int) -> str:
        from websockets.sync.client import connect

        finals: Counter[str] = Counter()
        with connect(f"ws://{self.host}:{self.port}/v1/stream", max_size=None, ping_interval=None) as ws:
            for frame in frames:
                ws.send(frame)
            ended: Counter[str] = Counter()
            while len(ended) < count:
                msg = json.loads(ws.recv(timeout=300))
                if msg["type"] == "delta":
                    continue
                ended[msg["request_id"]] += 1
                finals[msg.get("finish_reason") or msg.get("code")] += 1
            twice = [r for r, k in ended.items() if k > 1]
            if twice:
                raise Violation(f"abort race: {twice[:5]} ended more than once")
        return f"{count} ended once each: " + ", ".join(f"{k} x{v}" for k, v in sorted(finals.items()))

    def non_reader(self) -> Action:
        """An SSE stream whose client never reads: the bridge must abort it, not buffer it."""
        # Tens of megabytes of events: far more than the socket buffers on both sides hold.
        body = json.dumps({"model": "demo", "prompt": [f"unread {i}" for i in range(64)], "max_tokens": 440,
                           "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
        return lambda: self._unread(body)

    def _unread(self, body: bytes) -> str:
        before = self.slow_reader_aborts()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((self.host, self.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        try:
            while self.slow_reader_aborts() == before:
                if time.monotonic() > deadline:
                    return "not aborted within 120 s"
                time.sleep(0.1)  # poll interval; the deadline bounds it
        finally:
            s.close()
        return "aborted by the bridge (slow reader)"

    def deep_json(self) -> Action:
        depth = self.n(100_000)
        http = self.post("/v1/completions", b'{"model":"demo","prompt":' + b"[" * depth + b"]" * depth + b"}")
        frame = b'{"type":"generate","request_id":"d","prompt":' + b"[" * depth
        return lambda: f"http {http()}; ws {self.ws_raw(frame)}"

    def bad_utf8(self) -> Action:
        http = self.post("/v1/completions", b'{"model":"demo","prompt":"\xff\xfe\xc3(","max_tokens":4}')
        frame = b'{"type":"generate","request_id":"u","prompt":"\xff\xfe","max_tokens":4}'
        return lambda: f"http {http()}; ws {self.ws_raw(frame)}"

    # ---- helpers -------------------------------------------------------------

    def ws_final(self, fields: dict[str, Any]) -> Action:
        frame = json.dumps({"type": "generate", "request_id": "h", "prompt": "hello", "max_tokens": 4,
                            **fields}).encode()
        return lambda: self.ws_raw(frame)

    def ws_raw(self, frame: bytes) -> str:
        """Send one websocket message (as bytes: a binary frame); its final reply, in a few words."""
        from websockets.sync.client import connect

        with connect(f"ws://{self.host}:{self.port}/v1/stream", max_size=None, ping_interval=None) as ws:
            ws.send(frame)
            while True:
                msg = json.loads(ws.recv(timeout=300))
                if msg["type"] == "error":
                    return f"error {msg['code']}: {str(msg['message'])[:90]}"
                if msg["type"] == "done":
                    return f"done {msg['finish_reason']}"

    def slow_reader_aborts(self) -> float:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        m = re.search(r'^noria_slow_reader_aborts_total\{surface="sse"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    def shapes(self) -> dict[str, Callable[[], Action]]:
        """Name -> what prepares the shape."""
        out: dict[str, Callable[[], Action]] = {
            "stop_strings": self.stop_strings, "bad_words": self.bad_words, "logit_bias": self.logit_bias,
            "messages": self.messages, "huge_role": self.huge_role, "responses_items": self.responses_items,
            "anthropic_blocks": self.anthropic_blocks,
        }
        for field in ("priority", "top_k", "max_tokens", "min_tokens"):
            out[f"2**64_{field}"] = self.big_int(field)
        out.update({"batches_8x128": self.batches, "abort_race": self.abort_race, "non_reader": self.non_reader,
                    "deep_json": self.deep_json, "bad_utf8": self.bad_utf8})
        return out


def run_hostile(host: str, port: int, scale: float = 1.0, only: list[str] | None = None,
                log: Callable[[str], None] = print) -> list[ShapeResult]:
    """Every shape (or those named in `only`) with a victim beside it; a baseline row first
    (the victim alone). Raises Violation where an answer breaks the protocol."""
    reference = Victim(host, port).one()
    attacker = Attacker(host, port, scale)
    shapes: dict[str, Callable[[], Action]] = {"baseline (victim alone)": lambda: lambda: "-"}
    shapes.update({k: v for k, v in attacker.shapes().items() if not only or k in only})
    results = []
    for name, prepare in shapes.items():
        action = prepare()
        victim = Victim(host, port, reference)
        victim.start()
        t0 = time.perf_counter()
        try:
            answer = action()
        finally:
            seconds = time.perf_counter() - t0
            victim.stop()
        r = ShapeResult(name, answer, round(victim.max_gap * 1000, 1), victim.unchanged, victim.completions,
                        round(seconds, 2))
        if victim.errors:
            r.answer += f" | victim: {victim.errors[0]}"
        results.append(r)
        log(f"{name}: {answer} | victim max gap {r.victim_max_gap_ms} ms, unchanged {r.victim_unchanged} "
            f"({r.victim_completions} completions) in {r.seconds}s")
    return results


def table(results: list[ShapeResult]) -> str:
    rows = ["| shape | answer | victim max gap (ms) | victim unchanged | victim completions | s |", "|---|---|---|---|---|---|"]
    rows += [f"| {r.shape} | {r.answer.replace('|', '/')} | {r.victim_max_gap_ms} | {r.victim_unchanged} | "
             f"{r.victim_completions} | {r.seconds} |" for r in results]
    return "\n".join(rows)


def as_json(results: list[ShapeResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
