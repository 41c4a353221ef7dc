"""`noria serve` as a real process on loopback, spoken to by the client library and raw zmq."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq

from noria import AsyncClient, Client, NoriaError, SamplingParams
from tests.procs import serve


@pytest.fixture(scope="module")
def server(demo_path):
    with serve("--num-kv-blocks", "128", "--max-model-len", "256") as (address, proc):
        yield address


def test_generate_stream_and_chat(server):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with Client(server) as c:
        out = c.generate("Hello, world", greedy)
        comp = out.outputs[0]
        assert len(comp.token_ids) == 12 and comp.finish_reason == "length" and comp.text
        deltas = list(c.stream("Hello, world", greedy))
        assert deltas[-1].finish_reason == "length"
        assert "".join(d.text for d in deltas[:-1]) == comp.text
        assert [t for d in deltas[:-1] for t in d.token_ids] == comp.token_ids
        chat = c.chat([{"role": "user", "content": "Hi there"}], SamplingParams(max_tokens=5, temperature=0.0))
        assert 1 <= len(chat.outputs[0].token_ids) <= 5


def test_many_requests_in_flight_on_one_client(server):
    async def main():
        async with AsyncClient(server) as c:
            params = [SamplingParams(max_tokens=4 + i % 7, temperature=0.0, ignore_eos=True) for i in range(24)]
            outs = await asyncio.gather(*(c.generate(f"request {i}", p) for i, p in enumerate(params)))
            return params, outs

    params, outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_staggered_arrivals_give_the_same_greedy_text(server):
    """Requests that board while others decode produce what they produce alone."""
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    with Client(server) as c:
        alone = [c.generate(q, p).outputs[0].token_ids for q in prompts]

    async def rest(ids: list[int], stream) -> list[int]:
        async for out in stream:
            ids.extend(getattr(out, "token_ids", []))
        return ids

    async def staggered() -> tuple[list[list[int]], str | None]:
        async with AsyncClient(server) as c:
            # A long request keeps a batch decoding for every arrival to board.
            anchor = c.stream("anchor", SamplingParams(max_tokens=None, ignore_eos=True), request_id="anchor")
            await anext(anchor)
            tasks = []
            for q in prompts:
                # Each one is decoding before the next arrives.
                stream = c.stream(q, p)
                first = await anext(stream)
                tasks.append(asyncio.create_task(rest(list(first.token_ids), stream)))
            outs = await asyncio.gather(*tasks)
            await c.abort("anchor")
            last = [out async for out in anchor][-1]
            return outs, last.finish_reason

    outs, anchor_end = asyncio.run(staggered())
    assert anchor_end == "abort", "the anchor finished early: the later arrivals did not board a running batch"
    assert outs == alone


def _raw(address: str, messages: list[object]) -> list[dict]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    for m in messages:
        s.send(m if isinstance(m, bytes) else msgspec.msgpack.encode(m))
    out = []
    try:
        while s.poll(30_000):
            msg = msgspec.msgpack.decode(s.recv())
            out.append(msg)
            if len([o for o in out if o["type"] in ("done", "error")]) == len(messages):
                break
    finally:
        s.close(0)
        ctx.term()
    return out


@pytest.mark.parametrize(
    "bad, code, words",
    [
        ({"type": "launch", "request_id": "b1"}, "invalid_message", "launch"),
        ({"type": "generate", "request_id": "b2", "prompt": "x", "max_tokens": "lots"}, "invalid_message", "max_tokens"),
        (b"\xc1 not msgpack", "invalid_message", ""),
        ({"type": "generate", "request_id": "b3", "prompt": ""}, "invalid_request", "empty"),
        ({"type": "generate", "request_id": "b4", "prompt": "word " * 400}, "prompt_too_long", "max_model_len"),
        ({"type": "generate", "request_id": "b5", "prompt": "x", "top_p": 1.5}, "invalid_request", "top_p"),
        ({"type": "generate", "request_id": "b6", "prompt": "x", "temperature": -2}, "invalid_request", "temperature"),
        ({"type": "generate", "request_id": "b7", "prompt_token_ids": [1, 10**6]}, "invalid_request", "vocabulary"),
    ],
)
def test_bad_input_gets_a_named_error_and_the_engine_keeps_serving(server, bad, code, words):
    good = {"type": "generate", "request_id": "ok", "prompt": "fine", "max_tokens": 3, "temperature": 0.0}
    out = _raw(server, [bad, good])
    errors = [m for m in out if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == code and words in errors[0]["message"]
    if isinstance(bad, dict):
        assert errors[0]["request_id"] == bad["request_id"]
    dones = [m for m in out if m["type"] == "done"]
    assert len(dones) == 1 and dones[0]["request_id"] == "ok" and dones[0]["usage"]["completion_tokens"] >= 1


def test_abort_mid_stream_ends_with_one_abort(server):
    out = _raw(server, [{"type": "generate", "request_id": "long", "prompt": "go", "max_tokens": 200, "ignore_eos": True}])
    assert out[-1]["type"] == "done"  # sanity: the request itself works
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(server)
    s.send(msgspec.msgpack.encode({"type": "generate", "request_id": "a", "prompt": "go", "max_tokens": 200, "ignore_eos": True}))
    first = msgspec.msgpack.decode(s.recv())
    assert first["type"] == "delta"
    s.send(msgspec.msgpack.encode({"type": "abort", "request_id": "a"}))
    finals = []
    while s.poll(3000):
        m = msgspec.msgpack.decode(s.recv())
        if m["type"] != "delta":
            finals.append(m)
    s.close(0)
    ctx.term()
    assert [(m["type"], m.get("finish_reason")) for m in finals] == [("done", "abort")]


def test_hello_names_the_model(server):
    with Client(server) as c:
        ready = c.hello()
    assert ready.model == "demo" and ready.max_model_len == 256


def test_client_times_out_instead_of_hanging():
    with Client("tcp://127.0.0.1:1", timeout=0.5) as c, pytest.raises(NoriaError, match="timeout"):
        c.generate("x")


def test_children_exit_when_the_server_is_killed(demo_path):
    import signal
    import subprocess
    import sys

    from noria.protocol.sockets import free_tcp_port
    from tests.procs import children_of, wait_gone, wait_ready

    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-m", "noria.frontend.cli", "serve", "--zmq-port", str(port),
                             "--port", str(free_tcp_port()), "--num-kv-blocks", "16"])
    try:
        wait_ready(f"tcp://127.0.0.1:{port}", proc)
        kids = children_of(proc.pid)
        names = [Path(f"/proc/{k}/cmdline").read_bytes() for k in kids]
        assert any(b"scheduler" in n for n in names) and any(b"worker" in n for n in names)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not wait_gone(kids, 60), "engine processes outlived a killed server"  # 60 s: only a hang


def _poll_stats(address: str, ok, timeout: float = 60.0):
    """Ask for stats until `ok(stats)` holds; returns the last answer either way (the
    deadline only bounds a hang)."""
    import time

    deadline = time.monotonic() + timeout
    with Client(address) as c:
        while True:
            s = c.stats()
            if ok(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


def _idle(s) -> bool:
    return s.num_open_requests == 0 and s.stats.num_running == 0 and s.stats.num_free_blocks == s.stats.num_kv_blocks


def test_a_vanished_client_has_its_requests_aborted(server):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(server)
    for i in range(3):
        s.send(msgspec.msgpack.encode({"type": "generate", "request_id": f"v{i}", "prompt": "go", "max_tokens": None, "ignore_eos": True}))
    assert msgspec.msgpack.decode(s.recv())["type"] == "delta"
    # Published stats lag a little behind: ask until they show the three requests.
    busy = _poll_stats(server, lambda st: st.stats.num_running + st.stats.num_waiting >= 1 and st.num_open_requests >= 3)
    assert busy.stats.num_running + busy.stats.num_waiting >= 1 and busy.num_open_requests >= 3
    s.close(0)
    ctx.term()
    idle = _poll_stats(server, _idle)
    assert idle.num_open_requests == 0 and idle.stats.num_running == 0
    assert idle.stats.num_free_blocks == idle.stats.num_kv_blocks and idle.stats.blocks_consistent
