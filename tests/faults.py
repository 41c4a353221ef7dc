"""Helpers for the fault tests: one mixed load over the three client kinds (the ZMQ client
library, the websocket and OpenAI SSE through the bridge), each stream's pieces collected
with its final message or error, and the processes of a `noria serve` found by name."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import openai
import websockets

from noria import AsyncClient, NoriaError, SamplingParams
from noria.protocol.client import Delta, Done, Stats
from tests.procs import children_of
from tests.workers import stats


@dataclass
class Stream:
    """One request as its client saw it: `finals` counts done/error messages (must be 1)."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # the error code, if it ended with one
    finals: int = 1
    late: int = 0  # messages that came after the final one (must be 0)


class Tripwire(list[int]):
    """A delta count kept as the stream helpers keep theirs (`progress[0] += 1`) that runs each
    `(mark, action)` on the counting thread, the moment the count reaches `mark`: a fault
    injected there lands after exactly that many deltas reached the client, however slow the
    machine (a thread polling the count may wake hundreds of deltas late, or after the load).
    An action that returns False is not done yet and is tried again at the next delta."""

    def __init__(self, *actions: tuple[int, Callable[[], bool | None]]) -> None:
        super().__init__([0])
        self.actions = sorted(actions, key=lambda a: a[0])
        self.fired: list[int] = []  # the count at which each action was done

    def __setitem__(self, index, value):  # noqa: ANN001 - list's own overloads
        super().__setitem__(index, value)
        while self.actions and self[0] >= self.actions[0][0]:
            if self.actions[0][1]() is False:
                return
            self.actions.pop(0)
            self.fired.append(self[0])


def server_stats(address: str) -> Stats:
    """The server's stats now; callable from an event loop's own thread (a Tripwire's action),
    as the blocking client runs on a thread of its own."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(stats, address).result(120)


def open_requests(address: str) -> int:
    return server_stats(address).num_open_requests


def children_named(server_pid: int, marker: bytes) -> list[int]:
    out = []
    for pid in children_of(server_pid):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


@contextmanager
def worker_stopped(server_pid: int) -> Iterator[int]:
    """The server's local worker stopped (SIGSTOP) for the block and resumed after it: what
    arrives meanwhile stays open, so a load sent over ZMQ, SSE and the websocket is all open
    at once (ZMQ requests are sent at once, the bridge's come later and would find them done).
    The server needs a --worker-timeout longer than the block."""
    (worker,) = children_named(server_pid, b"noria.worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        yield worker
    finally:
        with suppress(ProcessLookupError):  # a worker the block killed may be gone
            os.kill(worker, signal.SIGCONT)


def kill_named(server_pid: int, marker: bytes) -> int:
    (pid,) = children_named(server_pid, marker)
    os.kill(pid, signal.SIGKILL)
    return pid


async def zmq_stream(client: AsyncClient, prompt: str, params: SamplingParams, progress: list[int]) -> Stream:
    out = Stream("zmq")
    try:
        async for msg in client.stream(prompt, params):
            if isinstance(msg, Delta):
                out.token_ids += msg.token_ids
                out.text += msg.text
                progress[0] += 1
            elif isinstance(msg, Done):
                out.finish_reason = msg.finish_reason
    except NoriaError as e:
        out.error = e.code
    return out


async def sse_stream(http: str, prompt: str, params: SamplingParams, progress: list[int]) -> Stream:
    out = Stream("sse")
    extra = {"ignore_eos": params.ignore_eos, "min_tokens": params.min_tokens,
             "repetition_penalty": params.repetition_penalty}
    async with openai.AsyncOpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        try:
            kw = {"seed": params.seed, "stop": params.stop}
            stream = await c.completions.create(
                model="demo", prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty, stream=True,
                extra_body=extra, **{k: v for k, v in kw.items() if v is not None})
            async for chunk in stream:
                if chunk.choices:
                    out.text += chunk.choices[0].text
                    progress[0] += 1
                    out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
        except openai.APIStatusError as e:
            out.error = (e.body or {}).get("code") if isinstance(e.body, dict) else str(e.status_code)
        except openai.APIError as e:  # an error event inside the stream
            out.error = (e.body or {}).get("code") if isinstance(e.body, dict) else e.message
    return out


def ws_message(rid: str, prompt: str, params: SamplingParams) -> str:
    body = msgspec.to_builtins(params)
    body.pop("type", None)
    return msgspec.json.encode({**body, "type": "generate", "request_id": rid, "prompt": prompt}).decode()


async def ws_streams(http: str, prompts: list[str], params: list[SamplingParams], progress: list[int]) -> list[Stream]:
    """Every prompt on one websocket; read until each has its final message."""
    outs = [Stream("ws", finals=0) for _ in prompts]
    async with websockets.connect(http.replace("http://", "ws://") + "/v1/stream", max_queue=None) as ws:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            await ws.send(ws_message(f"w{i}", prompt, p))
        while sum(o.finals for o in outs) < len(outs):
            m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 120))
            out = outs[int(m["request_id"][1:])]
            out.late += out.finals > 0
            if m["type"] == "delta":
                out.token_ids += m["token_ids"]
                out.text += m["text"]
                progress[0] += 1
            elif m["type"] == "done":
                out.finals += 1
                out.finish_reason = m["finish_reason"]
            elif m["type"] == "error":
                out.finals += 1
                out.error = m["code"]
    return outs


async def _mixed(address: str, http: str, prompts: list[str], params: list[SamplingParams],
                 progress: list[int]) -> list[Stream]:
    """Prompt i goes over ZMQ, SSE or the websocket by i % 3."""
    zmq_i = [i for i in range(len(prompts)) if i % 3 == 0]
    sse_i = [i for i in range(len(prompts)) if i % 3 == 1]
    ws_i = [i for i in range(len(prompts)) if i % 3 == 2]
    async with AsyncClient(address, timeout=120) as client:
        zmq = [zmq_stream(client, prompts[i], params[i], progress) for i in zmq_i]
        sse = [sse_stream(http, prompts[i], params[i], progress) for i in sse_i]
        ws = ws_streams(http, [prompts[i] for i in ws_i], [params[i] for i in ws_i], progress)
        *singles, ws_out = await asyncio.gather(*zmq, *sse, ws)
    out: list[Stream | None] = [None] * len(prompts)
    for i, s in zip(zmq_i + sse_i, singles, strict=True):
        out[i] = s
    for i, s in zip(ws_i, ws_out, strict=True):
        out[i] = s
    return [s for s in out if s is not None]


def mixed_load(address: str, http: str, prompts: list[str], params: list[SamplingParams],
               progress: list[int] | None = None) -> list[Stream]:
    """Every prompt at once, a third each over ZMQ, SSE and the websocket; `progress[0]`
    counts the deltas received."""
    return asyncio.run(_mixed(address, http, prompts, params, progress if progress is not None else [0]))
