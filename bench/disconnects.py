"""`noria bench disconnects --clients 500`: clients that vanish mid-stream, mixed over every surface.

A third of the vanishing clients are raw ZMQ DEALERs that close their socket, a
third websockets whose TCP connection is cut (no close handshake), a third HTTP
SSE streams whose connection is cut; each leaves after its first delta. Beside
them, well-behaved clients on each surface run greedy requests to the end. Then
every orphaned request must be aborted within a bound (the frontend holds no open
request and no KV block is in use), and the well-behaved outputs must equal a
reference run made before the storm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
import msgspec
import websockets
import zmq
import zmq.asyncio

from noria.bench.fuzz_drivers import Violation, check_engine
from noria.frontend.client import AsyncClient
from noria.frontend.local_server import LocalServer
from noria.protocol.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7]
LONG = 200  # tokens a vanishing client asks for: it is still streaming when it leaves
KEEP_TOKENS = 16
SERVER_FLAGS = ("--num-kv-blocks", "2048", "--max-model-len", "256", "--max-num-seqs", "64")


def _generate(rid: str, max_tokens: int) -> dict[str, Any]:
    return {"type": "generate", "request_id": rid, "prompt_token_ids": PROMPT, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}


async def _zmq_vanisher(ctx: zmq.asyncio.Context, address: str, i: int) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    await sock.send(msgspec.msgpack.encode(_generate(f"v{i}", LONG)))
    while msgspec.msgpack.decode(await sock.recv())["type"] != "delta":
        pass
    sock.close(0)


async def _ws_vanisher(url: str, i: int) -> None:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps(_generate(f"v{i}", LONG)))
        while json.loads(await ws.recv())["type"] != "delta":
            pass
        ws.transport.abort()  # the connection is cut: no close frame reaches the server


async def _sse_vanisher(session: aiohttp.ClientSession, http: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True, "stream": True}
    resp = await session.post(f"{http}/v1/completions", json=body)
    if resp.status != 200:
        raise Violation(f"SSE request answered {resp.status}: {await resp.text()}")
    async for line in resp.content:
        if line.startswith(b"data: {"):
            break
    resp.connection.transport.abort()  # type: ignore[union-attr]
    resp.close()


async def _keepers(address: str, http: str, session: aiohttp.ClientSession, reference: list[int],
                   reference_text: str, n: int) -> None:
    """`n` well-behaved requests per surface, run to the end; each must equal the reference."""
    params = SamplingParams(max_tokens=KEEP_TOKENS, temperature=0.0, ignore_eos=True)

    async def over_zmq(c: AsyncClient) -> None:
        out = await c.generate(PROMPT, params)
        if out.outputs[0].token_ids != reference:
            raise Violation(f"a ZMQ client's output changed: {out.outputs[0].token_ids} != {reference}")

    async def over_ws(i: int) -> None:
        async with websockets.connect(http.replace("http://", "ws://") + "/v1/stream") as ws:
            await ws.send(json.dumps(_generate(f"k{i}", KEEP_TOKENS)))
            ids: list[int] = []
            while (m := json.loads(await ws.recv()))["type"] == "delta":
                ids += m["token_ids"]
        if m["type"] != "done" or ids != reference:
            raise Violation(f"a websocket client's output changed: {m} {ids} != {reference}")

    async def over_http() -> None:
        body = {"prompt": PROMPT, "max_tokens": KEEP_TOKENS, "temperature": 0.0, "ignore_eos": True}
        async with session.post(f"{http}/v1/completions", json=body) as r:
            text = (await r.json())["choices"][0]["text"]
        if text != reference_text:
            raise Violation(f"an HTTP client's output changed: {text!r} != {reference_text!r}")

    async with AsyncClient(address) as c:
        await asyncio.gather(*(over_zmq(c) for _ in range(n)), *(over_ws(i) for i in range(n)),
                             *(over_http() for _ in range(n)))


async def storm(address: str, http: str, clients: int, keepers: int = 3, abort_bound: float = 60.0) -> dict[str, Any]:
    """Run the storm against a running server; figures, or Violation."""
    from noria.frontend.client import Client

    with Client(address) as c:
        ref = c.generate(PROMPT, SamplingParams(max_tokens=KEEP_TOKENS, temperature=0.0, ignore_eos=True))
        tokens_before = _generated(c)
    reference, reference_text = ref.outputs[0].token_ids, ref.outputs[0].text
    ctx = zmq.asyncio.Context()
    ws_url = http.replace("http://", "ws://") + "/v1/stream"
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        vanishers = []
        for i in range(clients):
            kind = i % 3
            vanishers.append(_zmq_vanisher(ctx, address, i) if kind == 0 else _ws_vanisher(ws_url, i) if kind == 1
                             else _sse_vanisher(session, http))
        await asyncio.wait_for(asyncio.gather(*vanishers, _keepers(address, http, session, reference,
                                                                     reference_text, keepers)), 300)
    vanished = time.perf_counter()
    ctx.term()
    idle_after = await asyncio.to_thread(_wait_idle, address, abort_bound)
    with Client(address) as c:
        generated = _generated(c) - tokens_before
    await asyncio.to_thread(check_engine, address, PROMPT, reference)
    # Had the orphans run to the end, the engine would have made clients * LONG tokens.
    if generated >= clients * LONG // 2:
        raise Violation(f"{generated} tokens generated for {clients} orphans: they were not aborted")
    return {"clients": clients, "keepers_per_surface": keepers, "storm_s": round(vanished - t0, 2),
            "orphans_aborted_within_s": round(idle_after, 2), "tokens_generated": generated,
            "tokens_if_not_aborted": clients * LONG}


def _generated(c: Any) -> int:
    """The engine's generation-token counter, fresh (the first answer may predate the query)."""
    c.stats()
    time.sleep(0.6)  # stats are published at most every 0.5 s; the next answer holds the query's
    return c.stats().stats.generation_tokens


def _wait_idle(address: str, bound: float) -> float:
    """Seconds until the frontend holds no open request and no KV block is in use."""
    from noria.frontend.client import Client

    t0 = time.monotonic()
    with Client(address) as c:
        while True:
            s = c.stats()
            if s.num_open_requests == 0 and s.stats.kv_cache_usage == 0 and s.stats.num_running == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > bound:
                raise Violation(f"orphaned requests still open after {bound}s: {s}")
            time.sleep(0.05)  # poll interval; the bound limits the wait


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench disconnects", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=500, help="clients that vanish mid-stream")
    ap.add_argument("--keepers", type=int, default=3, help="well-behaved clients per surface")
    args = ap.parse_args(argv)
    with LocalServer(*SERVER_FLAGS) as server:
        server.wait(http=True)
        report = asyncio.run(storm(server.address, server.http, args.clients, args.keepers))
    print(json.dumps(report, indent=1))
    print(f"{args.clients} vanished clients: every orphan aborted within {report['orphans_aborted_within_s']}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
