"""The client (aiohttp) that drives a `llama-server`: token-id prompts to its native
`/completion`, greedy, `ignore_eos`, no prompt cache; W1 batches, serving's timed requests,
and one request alone for batch-1 latency.
"""

from __future__ import annotations

import asyncio
import json
import time

from noria.bench.llama_cpp_server import LlamaServer


def completion_body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """llama-server's native /completion for a token-id prompt: greedy, exactly `max_tokens`
    tokens, no prompt cache (noria's runs here have none either).

    `ignore_eos` in llama.cpp biases every end-of-generation token to -inf (noria's only keeps
    going past one), so greedy outputs part where noria's argmax is such a token. The sampler
    chain is the temperature stage alone: at temperature 0 it keeps the argmax, which the
    default chain's top-k/top-p/min-p stages before it never change, and they would each pass
    over the whole vocabulary per token."""
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": stream, "return_tokens": True, "samplers": ["temperature"]}


def completion_tokens(response: dict) -> list[int]:
    """The generated token ids of a non-streamed /completion answer."""
    return list(response["tokens"])


def stream_tokens(line: bytes) -> list[int] | None:
    """The token ids one server-sent-events line of a streamed /completion carries (None: not a
    data line). Every sampled token comes in its own event, text or not; the final event (stop:
    true) repeats none of them."""
    if not line.startswith(b"data: "):
        return None
    event = json.loads(line[6:])
    if "error" in event:
        raise RuntimeError(f"llama-server: {event['error']}")
    return list(event.get("tokens") or [])


def session(aiohttp):
    # A connection per request: llama-server (cpp-httplib) can drop a kept-alive connection after a
    # streamed answer, and the next request on it fails with "Can not write request body".
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=3600))


async def stream(http, base: str, prompt: list[int], max_tokens: int,
                 exact: bool = False) -> tuple[float, list[float], list[int], dict]:
    """One streamed request: when it was sent, each token's arrival time, the token ids, and the
    final event's `timings` (llama.cpp's counts: drafted and accepted tokens among them).
    `exact`: RuntimeError unless all `max_tokens` came (a timed measurement needs every one)."""
    sent = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    timings: dict = {}
    async with http.post(f"{base}/completion", json=completion_body(prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.content:
            got = stream_tokens(line)
            if got:
                now = time.perf_counter()
                times.extend([now] * len(got))
                ids.extend(got)
            elif got is not None:
                timings = json.loads(line[6:]).get("timings") or timings
    if exact and len(times) != max_tokens:
        raise RuntimeError(f"llama-server streamed {len(times)} tokens, asked for {max_tokens}")
    return sent, times, ids, timings


async def complete(http, base: str, prompt: list[int], max_tokens: int) -> dict:
    """One non-streamed request: llama-server's answer (its `tokens`, its `timings`)."""
    async with http.post(f"{base}/completion", json=completion_body(prompt, max_tokens, False)) as r:
        r.raise_for_status()
        return await r.json()


async def run_batch(base: str, work, in_flight: int) -> tuple[float, list[list[int]]]:
    """Every request of `work`, at most `in_flight` at a time; wall seconds and each one's tokens."""
    import aiohttp

    gate = asyncio.Semaphore(in_flight)
    async with session(aiohttp) as http:

        async def one(prompt: list[int], max_tokens: int) -> list[int]:
            async with gate:
                return completion_tokens(await complete(http, base, prompt, max_tokens))

        await one(work[0][0], 2)  # warm-up, as noria-serve's
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, m) for p, m in work))
        return time.perf_counter() - t0, outs


async def drive(base: str, reqs) -> list[dict]:
    """bench/serving.py's rates: each request sent at its offset, streamed; per-token arrival times."""
    import aiohttp

    async with session(aiohttp) as http:
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, offset: float) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            sent, times, _, _ = await stream(http, base, prompt, max_tokens)
            return {"sent": sent, "times": times, "prompt_len": len(prompt)}

        return await asyncio.gather(*(one(*r) for r in reqs))


# --- batch-1 latency --------------------------------------------------------------------------

LATENCY_PROMPT = [9, 10, 11, 12]  # noria.bench.gemm_bf16.engine_ms_per_token's


async def _ms_per_token(base: str, tokens: int) -> tuple[float, list[int]]:
    import aiohttp

    async with session(aiohttp) as http:
        await stream(http, base, LATENCY_PROMPT, 16)  # warm-up
        _, times, ids, _ = await stream(http, base, LATENCY_PROMPT, tokens + 1, exact=True)
    return (times[-1] - times[0]) / tokens * 1e3, ids


def ms_per_token(server: LlamaServer, tokens: int = 256) -> tuple[float, list[int]]:
    """One request alone, streamed: milliseconds per output token after the first (the first
    carries the prompt), and the greedy tokens."""
    return asyncio.run(_ms_per_token(server.http, tokens))
