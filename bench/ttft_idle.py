"""`noria bench ttft_idle`: time to first token after the server has been idle, against back to back.

Sequential requests (one in flight at a time) of a `--prompt-len`-token random prompt against
`noria serve` on the "serving" model: each round sends one request after `--gap` seconds with
nothing running ("gap"), then one at once after its last token ("b2b"), through HTTP (streamed
`/v1/completions`, bench/serving_http.py's request) and through the ZMQ client. TTFT is the
client's: send to first token. A server whose TTFT after a gap is well above back to back pays
an idle cost (issue 15: threads and vCPUs that have gone to sleep).

`--arm NAME:K=V,K=V` (repeatable) starts one server per arm with those environment variables
(e.g. `--arm base:NORIA_X=0 --arm new:`); the arms run interleaved round by round, so an A/B
on a shared machine compares medians taken in the same minutes. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from noria.bench.serving import RATE_FLAGS
from noria.bench.workloads import serving_checkpoint
from noria.frontend.local_server import LocalServer

Arm = tuple[str, dict[str, str]]


def parse_arm(text: str) -> Arm:
    """"name:K=V,K=V" -> (name, {K: V}); "name:" or "name" -> no extra variables."""
    name, _, rest = text.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


Timed = tuple[float, list[float]]  # TTFT, then the gaps between later token arrivals (s)


def _timed(sent: float, arrivals: list[float]) -> Timed:
    assert arrivals, "no token came back"
    return arrivals[0] - sent, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


async def _http_ttft(http, base: str, prompt: list[int], max_tokens: int) -> Timed:  # noqa: ANN001 - aiohttp session
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 1}
    sent = time.perf_counter()
    arrivals = []
    async with http.post(f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    return _timed(sent, arrivals)


async def _zmq_ttft(client, prompt: list[int], max_tokens: int) -> Timed:  # noqa: ANN001 - AsyncClient
    from noria import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent = time.perf_counter()
    arrivals = []
    async for out in client.stream(prompt, params):
        if getattr(out, "token_ids", None):
            arrivals.append(time.perf_counter())
    return _timed(sent, arrivals)


async def probe(servers: dict[str, LocalServer], rounds: int, gap: float, prompt_len: int, max_tokens: int,
                paths: list[str]) -> dict[tuple[str, str, str], list[Timed]]:
    """{(arm, path, "gap" | "b2b"): [(TTFT, ITLs)]}: per round, per arm, per path: a gap, then back to back."""
    import aiohttp

    from noria import AsyncClient

    rng = random.Random(0)
    out: dict[tuple[str, str, str], list[Timed]] = {}
    clients = {name: AsyncClient(s.address, timeout=120) for name, s in servers.items()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for name, s in servers.items():  # warm-up: connections open, first-step costs paid
            for _ in range(2):
                await _http_ttft(http, s.http, [rng.randrange(3, 32000) for _ in range(prompt_len)], max_tokens)
                await _zmq_ttft(clients[name], [rng.randrange(3, 32000) for _ in range(prompt_len)], max_tokens)
        for r in range(rounds):
            names = list(servers)
            names = names[r % len(names):] + names[:r % len(names)]  # rotate: no arm always goes first
            for name in names:
                for path in paths:
                    for cond in ("gap", "b2b"):
                        if cond == "gap":
                            await asyncio.sleep(gap)
                        prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]  # no prefix-cache hit
                        t = (await _http_ttft(http, servers[name].http, prompt, max_tokens) if path == "http"
                             else await _zmq_ttft(clients[name], prompt, max_tokens))
                        out.setdefault((name, path, cond), []).append(t)
    for c in clients.values():
        c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench ttft_idle")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of idle before each 'gap' request")
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--paths", default="http,zmq")
    ap.add_argument("--arm", action="append", default=[], help="NAME:K=V,... one server per arm (default: one, 'noria')")
    ap.add_argument("--out", default="bench/results/ttft-idle")
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm] or [("noria", {})]
    model = serving_checkpoint()
    servers: dict[str, LocalServer] = {}
    try:
        for name, env in arms:
            servers[name] = LocalServer("--model", str(model), *RATE_FLAGS, env={**os.environ, **env})
        for s in servers.values():
            s.wait(timeout=300, http=True)
        res = asyncio.run(probe(servers, args.rounds, args.gap, args.prompt_len, args.max_tokens,
                                args.paths.split(",")))
    finally:
        for s in servers.values():
            s.stop()
    rows = []
    print(f"{'arm':<12} {'path':<5} {'gap p50':>8} {'b2b p50':>8} {'idle cost':>9} {'ITL p50':>8}  (TTFT and ITL ms, "
          f"{args.rounds} rounds, {args.gap:g} s gap, {args.prompt_len}-token prompts)")
    for name, _ in arms:
        for path in args.paths.split(","):
            gap = [t for t, _ in res[(name, path, "gap")]]
            b2b = [t for t, _ in res[(name, path, "b2b")]]
            itl = [x for cond in ("gap", "b2b") for _, xs in res[(name, path, cond)] for x in xs]
            g, b = statistics.median(gap) * 1000, statistics.median(b2b) * 1000
            i = statistics.median(itl) * 1000 if itl else float("nan")
            rows.append({"arm": name, "path": path, "gap_p50_ms": g, "b2b_p50_ms": b, "itl_p50_ms": i,
                         "gap_ms": [x * 1000 for x in gap], "b2b_ms": [x * 1000 for x in b2b]})
            print(f"{name:<12} {path:<5} {g:8.1f} {b:8.1f} {g - b:9.1f} {i:8.2f}")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arms": [a[0] for a in arms], "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
