"""The bridge SIGKILLed under load: its HTTP and websocket clients see their connections
close (no half message passed off as a whole), the engine aborts their requests (their KV
blocks come back, far fewer tokens are generated than they asked for), a ZMQ client's
stream goes on untouched, and `noria serve` starts a new bridge that serves HTTP again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import openai
import websockets

from noria import Client, SamplingParams
from tests.faults import children_named, kill_named, worker_stopped, ws_message, zmq_stream
from tests.procs import serve_http, wait_http
from tests.workers import stats, wait_for, wait_stats

BRIDGE = b"\x00bridge\x00"
LONG = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)
MEDIUM = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


async def _sse_until_cut(http: str, prompt: str, progress: list[int]) -> str:
    """Stream until the connection breaks; what ended it ("finished" if it did not break)."""
    async with openai.AsyncOpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        try:
            stream = await c.completions.create(model="demo", prompt=prompt, max_tokens=LONG.max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                progress[0] += 1
        except Exception as e:  # the kind depends on where the cut lands (httpx or openai's wrapper)
            return type(e).__name__
    return "finished"


async def _ws_until_cut(http: str, progress: list[int]) -> str:
    try:
        async with websockets.connect(http.replace("http://", "ws://") + "/v1/stream") as ws:
            for i in range(2):
                await ws.send(ws_message(f"w{i}", f"websocket {i}", LONG))
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if m["type"] != "delta":
                    return m["type"]
                progress[0] += 1
    except websockets.ConnectionClosed as e:
        return type(e).__name__


async def _load(served, progress: list[int]) -> tuple[list[str], list[int]]:
    from noria import AsyncClient

    async with AsyncClient(served.address, timeout=120) as client:
        zmq = zmq_stream(client, "the ZMQ client's story", MEDIUM, [0])
        cut = [_sse_until_cut(served.http, f"sse {i}", progress) for i in range(2)]
        *ends, ws_end, zmq_out = await asyncio.gather(*cut, _ws_until_cut(served.http, progress), zmq)
    return [*ends, ws_end], zmq_out.token_ids


def test_a_killed_bridge_is_restarted_and_its_clients_requests_are_aborted(demo_path):
    with serve_http("--num-kv-blocks", "256", "--max-model-len", "2048", "--worker-timeout", "120") as served:
        with Client(served.address, timeout=60) as c:
            reference = c.generate("after the restart", SHORT).outputs[0].text
            calm_zmq = c.generate("the ZMQ client's story", MEDIUM).outputs[0].token_ids
        before = stats(served.address).stats
        progress, result = [0], []
        t = threading.Thread(target=lambda: result.append(asyncio.run(_load(served, progress))), daemon=True)
        with worker_stopped(served.proc.pid):  # all five open at once: the ZMQ one comes first
            t.start()
            wait_for("5 open requests", lambda: stats(served.address).num_open_requests == 5, 120)
        wait_for("some deltas", lambda: progress[0] >= 4, 120)
        old = kill_named(served.proc.pid, BRIDGE)
        t.join(120)

        (ends, zmq_ids), = result
        assert all(end not in ("finished", "done", "error") for end in ends), ends
        assert zmq_ids == calm_zmq, "the ZMQ client's stream was disturbed by the bridge's death"
        after = wait_stats(served.address, lambda st: st.num_open_requests == 0 and st.stats.num_running == 0
                           and st.stats.kv_cache_usage == 0, "the dead bridge's requests to be aborted").stats
        asked = 4 * LONG.max_tokens + MEDIUM.max_tokens
        assert after.generation_tokens - before.generation_tokens < asked, "the cut requests ran to their end"
        assert after.num_free_blocks == after.num_kv_blocks and after.blocks_consistent

        wait_http(served.http, served.proc, 60)
        (new,) = children_named(served.proc.pid, BRIDGE)
        assert new != old
        body = json.dumps({"model": "demo", "prompt": "after the restart", "max_tokens": SHORT.max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{served.http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["choices"][0]["text"] == reference
