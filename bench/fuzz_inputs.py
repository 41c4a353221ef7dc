"""Hypothesis strategies for what the internet may send: ZMQ frames, websocket messages, HTTP requests.

Each strategy mixes well-formed requests (so that accepted requests, aborts and
duplicate ids are exercised too) with values of every wrong kind: wrong types,
NaN and infinities, negative and enormous numbers, invalid UTF-8, truncated and
deeply nested data and huge frames. Valid requests ask for a few tokens only, so
that thousands of inputs fit in seconds.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import strategies as st

GENERATE_FIELDS = (
    "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
    "priority", "add_generation_prompt",
)
MSGPACK_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1])
EDGE_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, -1e308, 5e-324])
SHORT_TEXT = st.text(max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), MSGPACK_INT, EDGE_INTS, st.floats(), EDGE_FLOATS, SHORT_TEXT)
ANY = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(SHORT_TEXT, c, max_size=4),
                   max_leaves=12)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), MSGPACK_INT, st.floats(allow_nan=False, allow_infinity=False),
                         SHORT_TEXT)
JSON_ANY = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(SHORT_TEXT, c, max_size=4),
                        max_leaves=12)

# Values that are valid for each field (small, so a valid request is quick).
VALID = {
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.integers(-1, 50), "min_p": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(0, 2**64 - 1), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 700), max_size=3), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2), "logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "skip_special_tokens": st.booleans(), "priority": MSGPACK_INT,
    "add_generation_prompt": st.booleans(),
}
REQUEST_IDS = st.one_of(st.sampled_from(["r1", "r2", "dup", ""]), SHORT_TEXT, ANY)
MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                           "content": st.one_of(SHORT_TEXT, ANY)}),
    st.dictionaries(SHORT_TEXT, ANY, max_size=3), ANY), max_size=3)
PROMPTS = st.one_of(SHORT_TEXT, st.integers(1, 2_000_000).map(lambda k: "x " * k), ANY)
PROMPT_IDS = st.one_of(st.lists(st.integers(0, 705), max_size=8), st.lists(MSGPACK_INT, max_size=4), ANY)


def _field(name: str, valid_only: bool) -> st.SearchStrategy[Any]:
    return VALID[name] if valid_only else st.one_of(VALID[name], VALID[name], ANY)


@st.composite
def generate_maps(draw: st.DrawFn) -> dict[str, Any]:
    """A `generate` map: one or none or several prompt kinds, each field valid or not."""
    valid_only = draw(st.booleans())
    msg: dict[str, Any] = {"type": "generate", "request_id": draw(REQUEST_IDS if not valid_only else SHORT_TEXT)}
    if valid_only:
        kind = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages"]))
        msg[kind] = draw({"prompt": st.text(min_size=1, max_size=30), "prompt_token_ids": st.lists(
            st.integers(0, 705), min_size=1, max_size=8), "messages": st.just([{"role": "user", "content": "hi"}])}[kind])
    kinds = draw(st.lists(st.sampled_from(["prompt", "messages", "prompt_token_ids"]), min_size=0, max_size=3,
                          unique=True)) if not valid_only else []
    for kind in kinds:
        msg[kind] = draw({"prompt": PROMPTS, "messages": MESSAGES, "prompt_token_ids": PROMPT_IDS}[kind])
    for name in draw(st.lists(st.sampled_from(GENERATE_FIELDS), max_size=6, unique=True)):
        msg[name] = draw(_field(name, valid_only))
    msg.setdefault("max_tokens", draw(st.integers(1, 6)))  # keep the default request short
    return msg


def client_maps(json_safe: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Any client → server map, known `type` or not."""
    other = st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["abort", "hello", "get_stats", "delta", "done", "GENERATE", ""]), ANY)},
        optional={"request_id": REQUEST_IDS, "protocol_version": ANY})
    maps = st.one_of(generate_maps(), generate_maps(), other)
    return maps if not json_safe else maps.map(_json_clean)


def _json_clean(m: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN, no infinities and no bytes: those become null."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")) and isinstance(v, float):
            return None
        if isinstance(v, bytes):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v
    return clean(m)


def _mutate(data: bytes, cuts: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in cuts:
        if out:
            out[pos % len(out)] = value
    return bytes(out)


INVALID_UTF8_STR = st.binary(min_size=1, max_size=8).map(lambda b: b"\xd9" + bytes([len(b) + 1]) + b"\xff" + b)


@st.composite
def msgpack_frames(draw: st.DrawFn) -> bytes:
    """Byte-level: valid maps mutated, truncated or spliced with bad UTF-8; nesting; noise; huge frames."""
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:  # deeply nested arrays or maps, inside a generate or alone
        depth = draw(st.integers(1, 100_000))
        nest = draw(st.sampled_from([b"\x91", b"\x81\xa1k"])) * depth + b"\xc0"
        return draw(st.sampled_from([nest, b"\x83\xa4type\xa8generate\xaarequest_id\xa1d\xa8messages" + nest
                                     + b"\xa6prompt\xa1x"]))
    if kind == 2:  # a huge frame (bin32 or str32) under the server's size limit, or a header that lies
        size = draw(st.integers(1, 8 * 2**20))
        head = draw(st.sampled_from([b"\xc6", b"\xdb"]))
        return head + size.to_bytes(4, "big") + (b"a" * size if draw(st.booleans()) else b"")
    valid = msgspec.msgpack.encode(draw(client_maps()))
    if kind == 3:
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))]
    if kind == 4:  # a string replaced by invalid UTF-8
        bad = draw(INVALID_UTF8_STR)
        i = valid.find(b"\xa8generate")
        return valid[:i] + bad + valid[i + 9:] if i >= 0 else bad + valid
    cuts = draw(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
    return _mutate(valid, cuts)


@st.composite
def ws_messages(draw: st.DrawFn) -> str | bytes:
    """A websocket message: JSON maps (valid or not), JSON of other shapes, text noise, bytes."""
    kind = draw(st.integers(0, 5))
    if kind <= 2:
        return json.dumps(draw(client_maps(json_safe=True)))
    if kind == 3:
        return json.dumps(draw(JSON_ANY))
    if kind == 4:
        text = json.dumps(draw(client_maps(json_safe=True)))
        return text[: draw(st.integers(0, len(text)))] + draw(st.text(max_size=8))
    return draw(st.binary(max_size=64))


# The first three take generation bodies (http_requests favours them).
HTTP_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
              "/v1/stream", "/", "/v1", "/v1/completions/", "/%00", "/..%2f..%2fetc%2fpasswd", "/v1/completions?x=%ff",
              "/v1/responses/resp_0", "/v1/responses/resp_0/cancel", "/v1/messages", "/v1/messages/count_tokens",
              # A pooling server's (a generating one answers them 400 naming its runner).
              "/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify"]
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@st.composite
def openai_bodies(draw: st.DrawFn) -> Any:
    """A completions or chat body with fuzzed fields (OpenAI's names)."""
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["prompt"] = draw(st.one_of(SHORT_TEXT, st.lists(st.integers(0, 705), max_size=5),
                                        st.lists(SHORT_TEXT, max_size=3), JSON_ANY))
    if draw(st.booleans()):
        body["messages"] = draw(st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                            "content": st.one_of(SHORT_TEXT, JSON_ANY)}), max_size=3), JSON_ANY))
    if draw(st.booleans()):  # /v1/responses: a string or items (messages, calls, call outputs, anything)
        body["input"] = draw(st.one_of(SHORT_TEXT, JSON_ANY, st.lists(st.one_of(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "x"]), "content": JSON_ANY}),
            st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning"]),
                                   "call_id": JSON_ANY, "name": JSON_ANY, "arguments": JSON_ANY, "output": JSON_ANY}),
            JSON_ANY), max_size=3)))
    names = ["model", "n", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "presence_penalty",
             "logit_bias", "top_k", "min_p", "ignore_eos", "min_tokens", "stop_token_ids", "logprobs",
             "top_logprobs", "echo", "best_of", "max_completion_tokens", "priority", "user", "instructions", "tools",
             "tool_choice", "text", "previous_response_id", "background", "store",
             "system", "stop_sequences", "thinking",  # Anthropic's (/v1/messages)
             "text_1", "text_2", "query", "documents", "top_n", "return_documents"]  # /v1/score, rerank
    for name in draw(st.lists(st.sampled_from(names), max_size=5, unique=True)):
        body[name] = draw(st.one_of(JSON_ANY, st.sampled_from([True, 1, 2, 0.5, "demo", None])))
    body["max_tokens"] = draw(st.one_of(st.integers(1, 4), st.integers(1, 4), JSON_ANY))
    body["max_output_tokens"] = draw(st.one_of(st.integers(1, 4), st.integers(1, 4), JSON_ANY))
    return body


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body)."""
    method = draw(st.sampled_from(["POST"] * 8 + ["GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    path = draw(st.one_of(st.sampled_from(HTTP_PATHS[:3]), st.sampled_from(HTTP_PATHS[:3]), st.sampled_from(HTTP_PATHS),
                          st.text(alphabet="abcdefghijklmnopqrstuvwxyz/%.?=&0123456789", max_size=30)
                          .map(lambda p: "/" + p)))
    headers = draw(st.dictionaries(
        st.sampled_from(["Content-Type", "Authorization", "Accept", "X-Request-Id", "Accept-Encoding", "Origin"]),
        HEADER_TEXT, max_size=3))
    kind = draw(st.integers(0, 3))
    if kind <= 1:
        body = json.dumps(draw(openai_bodies())).encode()
    elif kind == 2:
        body = draw(st.binary(max_size=64))
    else:
        text = json.dumps(draw(openai_bodies()))
        body = text[: draw(st.integers(0, len(text)))].encode()
    return method, path, headers, body


RAW_HTTP = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"GET / HTTP/1.1\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999\r\n\r\n{",
                     b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n",
                     b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                     b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
                     b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 500 + b"\r\n"]),
)
