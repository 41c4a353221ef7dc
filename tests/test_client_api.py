"""The ZMQ client API against one live server: first the wire format as
docs/protocol.md writes it, spoken with raw pyzmq + msgspec (no noria code on
the client side: plain dicts in and out, every field's name and type checked,
as a client in another language relies on them); then `noria.Client` and
`AsyncClient` with many requests in flight, under uvloop and from threads.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import uvloop
import zmq

from noria import AsyncClient, Client, SamplingParams
from tests.procs import serve

_ids = itertools.count()


@pytest.fixture(scope="module")
def address(demo_path):
    with serve("--num-kv-blocks", "128", "--max-model-len", "256") as (addr, _proc):
        yield addr


class Raw:
    """A DEALER socket that sends msgpack maps and reads them back."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg: dict | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))

    def recv(self, timeout_ms: int = 30_000) -> dict:
        assert self.sock.poll(timeout_ms), "no answer from the server"
        msg = msgspec.msgpack.decode(self.sock.recv())
        assert isinstance(msg, dict) and isinstance(msg["type"], str)
        return msg

    def until_final(self, rid: str) -> list[dict]:
        out = []
        while True:
            m = self.recv()
            if m.get("request_id") == rid:
                out.append(m)
                if m["type"] in ("done", "error"):
                    return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw(address):
    r = Raw(address)
    yield r
    r.close()


def _rid() -> str:
    return f"p{next(_ids)}"


def _check_delta(m: dict) -> None:
    assert set(m) >= {"type", "request_id", "index", "text", "token_ids", "logprobs"}
    assert isinstance(m["index"], int) and isinstance(m["text"], str)
    assert isinstance(m["token_ids"], list) and all(isinstance(t, int) for t in m["token_ids"])
    if m["logprobs"] is not None:
        for lp in m["logprobs"]:
            assert set(lp) == {"token_id", "logprob", "top_token_ids", "top_logprobs", "token", "bytes", "top_tokens",
                               "top_bytes"}
            assert isinstance(lp["token_id"], int) and isinstance(lp["logprob"], float)
            assert isinstance(lp["token"], str) and all(isinstance(b, int) for b in lp["bytes"])
            assert len(lp["top_tokens"]) == len(lp["top_bytes"]) == len(lp["top_token_ids"])


def _check_done(m: dict) -> None:
    assert m["type"] == "done"
    assert m["finish_reason"] in ("stop", "length", "abort")
    assert set(m["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert 0 <= m["usage"]["cached_tokens"] < m["usage"]["prompt_tokens"]
    assert all(isinstance(v, int) for v in m["usage"].values())
    assert m["finish_reasons"] is None or all(r in ("stop", "length", "abort") for r in m["finish_reasons"])
    assert m["prompt_token_ids"] is None or all(isinstance(t, int) for t in m["prompt_token_ids"])


def test_generate_streams_deltas_then_one_done(raw):
    rid = _rid()
    raw.send({"type": "generate", "request_id": rid, "prompt": "Hello", "max_tokens": 7,
              "temperature": 0.0, "ignore_eos": True, "logprobs": 2})
    out = raw.until_final(rid)
    deltas, done = out[:-1], out[-1]
    for d in deltas:
        assert d["type"] == "delta"
        _check_delta(d)
        assert all(len(lp["top_token_ids"]) == 2 == len(lp["top_logprobs"]) for lp in d["logprobs"])
    _check_done(done)
    assert done["finish_reason"] == "length"
    assert sum(len(d["token_ids"]) for d in deltas) == 7 == done["usage"]["completion_tokens"]
    assert done["usage"]["prompt_tokens"] == len(done["prompt_token_ids"])


def test_token_ids_messages_and_n_samples(raw):
    rid = _rid()
    raw.send({"type": "generate", "request_id": rid, "prompt_token_ids": [0, 44, 559], "n": 3,
              "max_tokens": 4, "seed": 3, "ignore_eos": True})
    out = raw.until_final(rid)
    done = out[-1]
    _check_done(done)
    assert done["prompt_token_ids"] == [0, 44, 559]
    assert done["finish_reasons"] == ["length"] * 3
    counts = {i: sum(len(d["token_ids"]) for d in out[:-1] if d["index"] == i) for i in range(3)}
    assert counts == {0: 4, 1: 4, 2: 4}

    rid = _rid()
    raw.send({"type": "generate", "request_id": rid, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 3, "temperature": 0.0, "add_generation_prompt": True, "priority": 0,
              "stop": ["zzz"], "top_k": 5, "top_p": 0.9, "min_p": 0.0, "presence_penalty": 0.1,
              "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
              "stop_token_ids": [1], "skip_special_tokens": True})
    _check_done(raw.until_final(rid)[-1])


def test_hello_and_get_stats(raw):
    raw.send({"type": "hello", "protocol_version": 1})
    ready = raw.recv()
    assert ready == {"type": "ready", "protocol_version": 1, "model": "demo",
                     "max_model_len": 256, "vocab_size": ready["vocab_size"]}
    assert isinstance(ready["vocab_size"], int) and ready["vocab_size"] > 0
    raw.send({"type": "get_stats"})
    stats = raw.recv()
    assert stats["type"] == "stats" and isinstance(stats["num_open_requests"], int)
    documented = {"num_running": int, "num_waiting": int, "num_swapped": int, "num_kv_blocks": int,
                  "num_free_blocks": int, "kv_cache_usage": float, "prefix_cache_queries": int,
                  "prefix_cache_hits": int, "num_preemptions": int, "num_swap_outs": int,
                  "num_swap_ins": int, "prompt_tokens": int, "computed_prompt_tokens": int,
                  "generation_tokens": int, "num_steps": int, "blocks_consistent": bool,
                  "workers_live": bool, "worker_status": str, "worker_restarts": int,
                  "requests_requeued": int, "tokens_recomputed": int, "seconds_without_worker": float,
                  "plan_bytes": int, "result_bytes": int, "steps_planned_ahead": int, "tokens_discarded": int,
                  "attention_backend": str, "attention_reason": str, "block_size": int, "num_cpu_blocks": int,
                  "kv_cache_dtype": str, "enable_prefix_caching": bool, "kv_transfers_held": int,
                  "kv_transfers_released": int, "kv_transfers_expired": int, "kv_pulls_ok": int, "kv_pulls_failed": int,
                  "kv_pull_bytes": int, "kv_pull_tokens": int, "kv_pull_seconds": float, "spec_drafts": int,
                  "spec_draft_tokens": int, "spec_accepted_tokens": int, "spec_accepted_per_pos": list}
    assert set(stats["stats"]) == set(documented)
    assert stats["stats"]["attention_backend"] in ("kernels", "torch")  # the live group's
    for name, kind in documented.items():
        assert isinstance(stats["stats"][name], kind), name


def test_abort_ends_with_done_abort(raw):
    rid = _rid()
    raw.send({"type": "generate", "request_id": rid, "prompt": "go", "max_tokens": 200, "ignore_eos": True})
    assert raw.recv()["type"] == "delta"
    raw.send({"type": "abort", "request_id": rid})
    finals = [m for m in raw.until_final(rid) if m["type"] != "delta"]
    assert len(finals) == 1
    _check_done(finals[0])
    assert finals[0]["finish_reason"] == "abort"
    raw.send({"type": "abort", "request_id": "never-existed"})  # answered by nothing
    raw.send({"type": "hello"})
    assert raw.recv()["type"] == "ready"


@pytest.mark.parametrize(
    "msg, code",
    [
        (b"\x93\x01\x02", "invalid_message"),  # msgpack, but an array
        ({"type": "generate", "request_id": "e1"}, "invalid_request"),  # no prompt at all
        ({"type": "generate", "request_id": "e2", "prompt": "x", "prompt_token_ids": [1]}, "invalid_request"),
        ({"type": "generate", "request_id": "e3", "prompt": "x", "n": 0}, "invalid_request"),
        ({"type": "generate", "request_id": "e4", "prompt": "x", "logprobs": 21}, "invalid_request"),
        ({"type": "generate", "request_id": "e5", "prompt": "word " * 400}, "prompt_too_long"),
        ({"type": "generate", "request_id": 7, "prompt": "x"}, "invalid_message"),
    ],
)
def test_error_codes(raw, msg, code):
    raw.send(msg)
    err = raw.recv()
    assert err["type"] == "error" and err["code"] == code and isinstance(err["message"], str)
    # `param` (the field at fault) is optional: present when a field is to blame.
    assert {"type", "request_id", "code", "message"} <= set(err) <= {"type", "request_id", "code", "message", "param"}
    if isinstance(msg, dict) and isinstance(msg.get("request_id"), str):
        assert err["request_id"] == msg["request_id"]
    else:
        assert err["request_id"] is None


def test_prefix_cache_hits_are_reported_in_usage(raw, address):
    """A repeated 100-token prompt: every whole block before its last token comes from the cache."""
    rng = random.Random(7)
    prompt = [rng.randrange(300, 700) for _ in range(100)]
    usages = []
    for _ in range(2):
        rid = _rid()
        raw.send({"type": "generate", "request_id": rid, "prompt_token_ids": prompt, "max_tokens": 2, "temperature": 0.0})
        done = raw.until_final(rid)[-1]
        _check_done(done)
        usages.append(done["usage"])
    assert [u["cached_tokens"] for u in usages] == [0, 96]  # 6 blocks of 16
    # The client library reports it as vLLM does, on the RequestOutput.
    with Client(address) as c:
        assert c.generate(prompt, SamplingParams(max_tokens=2)).num_cached_tokens == 96
        assert c.generate(prompt[:50] + [1] * 50, SamplingParams(max_tokens=2)).num_cached_tokens == 48


def test_duplicate_request_id(raw):
    raw.send({"type": "generate", "request_id": "dup", "prompt": "go", "max_tokens": 50, "ignore_eos": True})
    raw.send({"type": "generate", "request_id": "dup", "prompt": "go", "max_tokens": 50, "ignore_eos": True})
    seen = []
    while not any(m["type"] == "done" for m in seen):
        seen.append(raw.recv())
    errors = [m for m in seen if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["duplicate_request"]


# ---- the client library -------------------------------------------------

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_many_streams_under_uvloop_and_from_threads(address):
    async def main() -> tuple[str, list[list[int]], list[list[int]]]:
        loop_kind = type(asyncio.get_running_loop()).__module__
        async with AsyncClient(address) as c:
            async def one(i: int) -> list[int]:
                ids = []
                async for out in c.stream(f"prompt {i}", GREEDY):
                    ids.extend(getattr(out, "token_ids", []))
                return ids

            streamed = await asyncio.gather(*(one(i) for i in range(64)))
            whole = await asyncio.gather(*(c.generate(f"prompt {i}", GREEDY) for i in range(64)))
        return loop_kind, streamed, [o.outputs[0].token_ids for o in whole]

    loop_kind, streamed, whole = uvloop.run(main())
    assert loop_kind.startswith("uvloop")
    assert all(len(ids) == 8 for ids in streamed) and streamed == whole

    # One blocking client shared by several threads.
    with Client(address) as c, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: c.generate(f"prompt {i}", GREEDY), range(16)))
        chat = c.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, temperature=0.0))
        assert c.connected
    assert [o.outputs[0].token_ids for o in outs] == whole[:16]
    assert 1 <= len(chat.outputs[0].token_ids) <= 3


def test_abort_and_early_exit_free_the_engine(address):
    async def main() -> tuple[str, int]:
        async with AsyncClient(address) as c:
            long = SamplingParams(max_tokens=None, ignore_eos=True)  # up to max_model_len
            outs = []
            async for out in c.stream("abort me", long, request_id="mine"):
                outs.append(out)
                if len(outs) == 2:
                    await c.abort("mine")
            # Leaving a stream early aborts it too.
            async for _ in c.stream("leave me", long):
                break
            # Poll until idle (published stats lag a query behind); the deadline only bounds a hang.
            deadline = time.monotonic() + 60
            while True:
                s = await c.stats()
                if s.num_open_requests == 0 and s.stats.num_running == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)  # poll interval
            return outs[-1].finish_reason, s.num_open_requests

    reason, still_open = uvloop.run(main())
    assert reason == "abort" and still_open == 0
