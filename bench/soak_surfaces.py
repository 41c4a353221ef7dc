"""The soak's clients, one per surface; each runs one job and returns what it saw (an Outcome).

* `zmq`: raw pyzmq DEALERs speaking msgpack maps, many requests per socket. One reader
  per socket files every message under its request id, so a second final message, or
  anything after the final one, is seen and counted, not dropped.
* `client`: noria's AsyncClient streaming (the library a Python user would take).
* `ws`: websockets, many requests per socket, read the same way as the raw DEALERs.
* `sse`: OpenAI completions with `"stream": true` over aiohttp; an abort cuts the connection.
* `http`: OpenAI completions without streaming.
An abort is sent (or the connection cut) after `abort_after` deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from noria.bench.soak_jobs import PROMPTS, VARIANTS, Job, Outcome, pick_stop
from noria.frontend.client import AsyncClient
from noria.protocol.client import Delta
from noria.protocol.errors import NoriaError
from noria.protocol.sampling import SamplingParams

SURFACES = {"zmq": 0.25, "client": 0.15, "ws": 0.25, "sse": 0.2, "http": 0.15}
STREAMING = ("zmq", "client", "ws", "sse")


class Multiplexed:
    """One connection carrying many requests (a raw DEALER or a websocket), read by one task."""

    def __init__(self, surface: str) -> None:
        self.surface = surface
        self.open: dict[str, tuple[Outcome, asyncio.Event]] = {}
        self.stray = 0  # messages for no request this connection sent
        self._ids = itertools.count()

    async def send(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def on_message(self, m: dict[str, Any]) -> asyncio.Future[None] | None:
        entry = self.open.get(m.get("request_id"))  # type: ignore[arg-type]
        if entry is None:
            self.stray += 1
            return None
        o, done = entry
        kind = m.get("type")
        if kind == "delta":
            o.delta(m.get("index", 0), m["text"], m["token_ids"])
            if o.abort_after is not None and o.deltas == o.abort_after:
                return asyncio.ensure_future(self.send({"type": "abort", "request_id": m["request_id"]}))
        elif kind == "done":
            o.final(m.get("finish_reasons") or [m["finish_reason"]], m["usage"]["completion_tokens"])
            done.set()
        else:
            o.final(None, None, f"{kind} {m.get('code')}: {m.get('message')}")
            done.set()
        return None

    async def run(self, job: Job, abort_after: int | None, timeout: float) -> Outcome:
        rid = f"{self.surface}{id(self) & 0xFFFF:x}-{next(self._ids)}"
        o = Outcome.new(self.surface, job, abort_after)
        done = asyncio.Event()
        self.open[rid] = (o, done)
        await self.send({"type": "generate", "request_id": rid, "prompt": PROMPTS[job.prompt], **job.params})
        with contextlib.suppress(TimeoutError):  # no final message within the bound: problems() calls it lost
            await asyncio.wait_for(done.wait(), timeout)
        return o  # stays in `open`: a late duplicate is still filed under it


class ZmqConn(Multiplexed):
    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__("zmq")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send(self, msg: dict[str, Any]) -> None:
        await self.sock.send(msgspec.msgpack.encode(msg))

    async def read(self) -> None:
        while True:
            self.on_message(msgspec.msgpack.decode(await self.sock.recv()))


class WsConn(Multiplexed):
    def __init__(self, ws: Any) -> None:
        super().__init__("ws")
        self.ws = ws

    async def send(self, msg: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(msg))

    async def read(self) -> None:
        async for raw in self.ws:
            self.on_message(json.loads(raw))


async def run_client(ac: AsyncClient, job: Job, abort_after: int | None, timeout: float) -> Outcome:
    o = Outcome.new("client", job, abort_after)
    rid = ac.new_request_id()

    async def consume() -> None:
        async for out in ac.stream(PROMPTS[job.prompt], SamplingParams(**job.params), request_id=rid):
            if isinstance(out, Delta):
                o.delta(out.index, out.text, out.token_ids)
                if o.deltas == abort_after:
                    await ac.abort(rid)
            else:
                o.final(out.finish_reasons or [out.finish_reason], out.usage.completion_tokens)

    try:
        await asyncio.wait_for(consume(), timeout)
    except NoriaError as e:
        o.final(None, None, f"{e.code}: {e.message}")
    except TimeoutError:
        pass  # lost, unless a final came
    return o


async def run_sse(session: aiohttp.ClientSession, http: str, job: Job, abort_after: int | None) -> Outcome:
    o = Outcome.new("sse", job, abort_after, with_ids=False)
    body = {"prompt": PROMPTS[job.prompt], "stream": True, "stream_options": {"include_usage": True}, **job.params}
    finished: dict[int, int] = {}
    usage: int | None = None
    async with session.post(f"{http}/v1/completions", json=body) as resp:
        if resp.status != 200:
            o.final(None, None, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return o
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                o.final([o.reasons[i] or "" for i in range(len(o.texts))], usage)
                continue
            chunk = json.loads(line[6:])
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            for c in chunk["choices"]:
                i = c["index"]
                if c.get("text"):
                    o.delta(i, c["text"], None)
                if c.get("finish_reason"):
                    finished[i] = finished.get(i, 0) + 1
                    o.after_final += finished[i] > 1  # a second finish for one sample
                    o.reasons[i] = c["finish_reason"]
            # The client leaves: no close, no final message owed. (No connection left: the
            # whole answer is already here, so there is nothing to cut; read it to the end.)
            if abort_after is not None and o.deltas >= abort_after and not o.finals and resp.connection:
                o.cut = True
                resp.connection.transport.abort()  # type: ignore[union-attr]
                break
    return o


async def run_http(session: aiohttp.ClientSession, http: str, job: Job) -> Outcome:
    o = Outcome.new("http", job, None, with_ids=False)
    async with session.post(f"{http}/v1/completions", json={"prompt": PROMPTS[job.prompt], **job.params}) as resp:
        if resp.status != 200:
            o.final(None, None, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return o
        body = await resp.json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for c in choices:
        o.delta(c["index"], c["text"], None)
    o.final([c["finish_reason"] for c in choices], body["usage"]["completion_tokens"])
    return o


async def build_jobs(address: str, http: str, session: aiohttp.ClientSession) -> list[Job]:
    """Every job's output, measured once on an idle server through the ZMQ client and the
    non-streaming HTTP API, which must agree."""
    jobs: list[Job] = []
    async with AsyncClient(address, timeout=300) as ac:
        for p, prompt in enumerate(PROMPTS):
            for variant in ("greedy", "long", "n2"):
                out = await ac.generate(prompt, SamplingParams(**VARIANTS[variant]))
                job = Job(p, variant, VARIANTS[variant], [c.text for c in out.outputs],
                          [c.token_ids for c in out.outputs], [c.finish_reason or "" for c in out.outputs])
                jobs.append(job)
                seen = await run_http(session, http, job)
                if seen.error or ["".join(t) for t in seen.texts] != job.texts:
                    raise RuntimeError(f"HTTP and ZMQ disagree on {job.key}: {seen.texts} != {job.texts}")
            greedy = jobs[-3]
            stop = pick_stop(greedy.texts[0])
            if stop is not None:
                text = greedy.texts[0]
                jobs.append(Job(p, "stop", {**VARIANTS["stop"], "stop": [stop]}, [text[:text.find(stop)]], None,
                                ["stop"]))
    return jobs
