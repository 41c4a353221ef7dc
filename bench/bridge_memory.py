"""`python -m noria.bench.bridge_memory`: the bridge's RSS before, during and after floods of
concurrent streaming requests that mostly wait in the engine's queue.

One `noria serve` on the demo model with a small `--max-num-seqs` (so a flood queues), no
queue cap. Each round opens `--sse` OpenAI SSE streams (one HTTP connection each) and
`--ws` websocket requests (over 4 sockets) at once, reads every one to its end, then waits
`--settle` seconds. The bridge's RSS (/proc, VmRSS and anonymous memory) is sampled all along:
a leak grows round after round; a high-water mark grows once and stays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import aiohttp

from noria.bench.overload import process_tree, rss_mib
from noria.frontend.local_server import LocalServer

WS_SOCKETS = 4


def anon_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _sse(session: aiohttp.ClientSession, http: str, i: int, max_tokens: int) -> bool:
    body = {"model": "demo", "prompt": f"flood {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with session.post(f"{http}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return False
        return any([line.strip() == b"data: [DONE]" async for line in resp.content])


async def _ws(session: aiohttp.ClientSession, http: str, n: int, first: int, max_tokens: int) -> int:
    done = 0
    async with session.ws_connect(http.replace("http://", "ws://") + "/v1/stream", max_msg_size=0) as ws:
        for i in range(n):
            await ws.send_str(json.dumps({"type": "generate", "request_id": f"r{i}", "prompt": f"flood {first + i}",
                                          "max_tokens": max_tokens, "ignore_eos": True}))
        while done < n:
            m = json.loads((await ws.receive()).data)
            done += m["type"] in ("done", "error")
    return done


async def flood(http: str, sse: int, ws: int, max_tokens: int) -> tuple[int, int]:
    """Every request at once; (finished, requested)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        per = [ws // WS_SOCKETS + (k < ws % WS_SOCKETS) for k in range(WS_SOCKETS)] if ws else []
        jobs = [_sse(session, http, i, max_tokens) for i in range(sse)]
        jobs += [_ws(session, http, n, sse + sum(per[:k]), max_tokens) for k, n in enumerate(per) if n]
        got = await asyncio.gather(*jobs)
    return int(sum(got)), sse + ws


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.stop = pid, interval, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.peak = max(self.peak, rss_mib(self.pid))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.bridge_memory")
    ap.add_argument("--sse", type=int, default=600)
    ap.add_argument("--ws", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--settle", type=float, default=5.0)
    args = ap.parse_args()
    with LocalServer("--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", "0",
                     "--max-requests-per-connection", "0") as server:
        server.wait(http=True)
        bridge = process_tree(server.proc.pid)["bridge"]
        asyncio.run(flood(server.http, 20, 4, args.max_tokens))  # warm-up: every code path once
        time.sleep(args.settle)
        base = rss_mib(bridge)
        print(f"bridge RSS after warm-up: {base:.1f} MiB (anonymous {anon_mib(bridge):.1f})")
        for r in range(args.rounds):
            sampler = Sampler(bridge)
            sampler.start()
            t0 = time.monotonic()
            ok, n = asyncio.run(flood(server.http, args.sse, args.ws, args.max_tokens))
            took = time.monotonic() - t0
            sampler.stop.set()
            sampler.join()
            time.sleep(args.settle)
            after = rss_mib(bridge)
            print(f"round {r + 1}: {ok}/{n} finished in {took:.1f}s; peak {sampler.peak:.1f} MiB "
                  f"(+{sampler.peak - base:.1f}), after {args.settle:g}s {after:.1f} MiB (+{after - base:.1f}, "
                  f"anonymous {anon_mib(bridge):.1f})", flush=True)


if __name__ == "__main__":
    main()
