"""`noria bench routing`: several engines behind a router on a multi-turn chat workload.

Conversations share a few long system prompts; each conversation sends its turns one after
another (a turn's prompt is the system prompt, the history so far and a new question), all
conversations at once. The same requests run against each configuration, each on fresh servers:

  one      one `noria serve`;
  dpN      `noria serve --data-parallel-size N` (the frontend routes: frontend/engine_group.py);
  rrN      N `noria serve` behind vllm-router, round-robin;
  caN      N `noria serve` behind vllm-router, cache-aware (its approximate radix tree over text).
Engines on this host split its cores (each rrN / caN server gets --num-threads cores / N, as a
dpN group gives its engines). `--across-namespaces` puts each server on a "host" of its own, a
network namespace the router reaches over a veth (bench/hosts.py; configs read NAME@hosts).

Reported: TTFT p50/p99, end-to-end p50/p99, requests/s and output tokens/s over the run, and the
prefix-cache hit rate summed over the engines (their own counters, before and after). On one
host the engines share its cores, so this measures routing (hits, balance), not scaling.
Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from noria.bench.hosts import separate_hosts
from noria.bench.plots import pyplot, save_rows
from noria.bench.serving import summary
from noria.bench.serving_http import _tokens_in
from noria.bench.workloads import CHECKPOINTS, serving_checkpoint
from noria.frontend.local_server import LocalServer, stop_child
from noria.protocol.sockets import free_tcp_port

WORDS = ["river", "stone", "maple", "cloud", "amber", "north", "quiet", "lamp", "field", "copper", "harbor", "violet", "engine", "paper", "winter", "garden", "silver", "meadow", "candle", "forest", "bridge", "orbit", "signal", "canvas", "marble", "thunder", "pepper", "lantern"]


def conversations(num: int, turns: int, systems: int, system_words: int, seed: int = 5) -> list[list[str]]:
    """Each conversation's prompts, turn by turn (the answers are not known in advance: a turn's
    history holds the questions only, which keeps every configuration's prompts identical)."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(system_words)) for _ in range(systems)]
    out = []
    for c in range(num):
        history = f"System: {prompts[c % systems]}\n"
        mine = []
        for t in range(turns):
            history += f"User {t}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) + "\n"
            mine.append(history + "Assistant:")
        out.append(mine)
    return out


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def _metric(http: str, name: str) -> float:
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


@contextlib.contextmanager
def _router(engines: list[LocalServer], policy: str) -> Iterator[str]:
    with vllm_router(["--policy", policy, "--worker-urls", *[e.http for e in engines]]) as url:
        yield url


@contextlib.contextmanager
def vllm_router(args: list[str]) -> Iterator[str]:
    """vllm-router with `args` on a free port (and a free port for its own metrics); its URL."""
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("vllm-router is not installed: pip install 'noria[bench]' (or vllm-router)")
    port = free_tcp_port()
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                             "--prometheus-port", str(free_tcp_port()), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm-router exited with {proc.returncode}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                break
            if time.monotonic() > deadline:
                raise SystemExit("vllm-router did not come up in 120 s")
            time.sleep(0.2)  # poll interval while it starts
        yield url
    finally:
        stop_child(proc, signal.SIGTERM, 30)


async def drive(url: str, convs: list[list[str]], max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def turn(prompt: str) -> dict:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "logprobs": 1, "return_tokens_as_token_ids": True}  # logprobs: every token is seen
            sent, times = time.perf_counter(), []
            async with http.post(f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                        now = time.perf_counter()
                        for c in json.loads(line[6:]).get("choices", []):
                            times.extend([now] * _tokens_in(c))
            return {"sent": sent, "times": times}

        async def conversation(prompts: list[str]) -> list[dict]:
            return [await turn(p) for p in prompts]

        return [r for rs in await asyncio.gather(*(conversation(c) for c in convs)) for r in rs]


def run_config(name: str, model: Path, convs: list[list[str]], max_tokens: int, flags: list[str],
               across: bool = False) -> dict:
    """One configuration on fresh servers; `across`: each server on a host of its own (bench/hosts.py)."""
    kind, n = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):] or 1)
    engine_flags = ["--model", str(model), *flags]
    if kind == "dp":
        engine_flags += ["--data-parallel-size", str(n)]
    if kind in ("rr", "ca"):  # the servers share this host's cores, as a dp group's engines do
        engine_flags += ["--num-threads", str(max(1, _cpus() // n))]
    count = 1 if kind in ("one", "dp") else n
    with contextlib.ExitStack() as hosts:
        if across:
            h = hosts.enter_context(separate_hosts(count))
            engines: list[Any] = [h.serve(i, engine_flags) for i in range(count)]
        else:
            engines = [LocalServer(*engine_flags) for _ in range(count)]
        row = _measure(kind, engines, convs, max_tokens)
    return {"config": name + ("@hosts" if across else ""), **row}


def _measure(kind: str, engines: list[Any], convs: list[list[str]], max_tokens: int) -> dict:
    try:
        for e in engines:
            e.wait(timeout=300, http=True)
        before = [(_metric(e.http, "noria_prefix_cache_hits_total"), _metric(e.http, "noria_prefix_cache_queries_total"))
                  for e in engines]
        with contextlib.ExitStack() as stack:
            url = engines[0].http if kind in ("one", "dp") else stack.enter_context(
                _router(engines, {"rr": "round_robin", "ca": "cache_aware"}[kind]))
            _post(f"{url}/v1/completions", {"prompt": "warm up", "max_tokens": 2})
            start = time.perf_counter()
            results = asyncio.run(drive(url, convs, max_tokens))
            span = time.perf_counter() - start
        hits = queries = 0.0
        for e, (h0, q0) in zip(engines, before, strict=True):
            hits += _metric(e.http, "noria_prefix_cache_hits_total") - h0
            queries += _metric(e.http, "noria_prefix_cache_queries_total") - q0
    finally:
        for e in engines:
            e.stop()
    ttft = [r["times"][0] - r["sent"] for r in results if r["times"]]
    e2e = [r["times"][-1] - r["sent"] for r in results if r["times"]]
    tokens = sum(len(r["times"]) for r in results)
    return {"requests": len(results), "ttft_ms": summary(ttft), "e2e_ms": summary(e2e),
            "req_s": len(results) / span, "out_tok_s": tokens / span, "hit_rate": hits / queries if queries else 0.0}


def _print(rows: list[dict]) -> None:
    f = lambda d: f"{d['p50']:.0f}/{d['p99']:.0f}"  # noqa: E731
    print(f"\n{'config':<12} {'requests':>8} {'TTFT p50/p99 ms':>16} {'E2E p50/p99 ms':>16} {'req/s':>7} "
          f"{'out tok/s':>9} {'prefix hit rate':>15}")
    for r in rows:
        print(f"{r['config']:<12} {r['requests']:>8} {f(r['ttft_ms']):>16} {f(r['e2e_ms']):>16} {r['req_s']:>7.2f} "
              f"{r['out_tok_s']:>9.1f} {r['hit_rate']:>15.1%}")


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["config"] for r in rows]
    axes[0].bar(names, [r["hit_rate"] * 100 for r in rows])
    axes[0].set_ylabel("prefix-cache hit rate (%)")
    for i, p in enumerate(("p50", "p99")):
        axes[1].bar([j + i * 0.4 for j in range(len(rows))], [r["ttft_ms"][p] for r in rows], 0.4, label=f"TTFT {p}")
    axes[1].set_xticks([j + 0.2 for j in range(len(rows))], names)
    axes[1].set_ylabel("ms")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="one,dp2,rr2,ca2", help="comma-separated: one, dpN, rrN, caN")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300, help="words of each shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--model", choices=sorted(CHECKPOINTS), default="serving")
    ap.add_argument("--across-namespaces", action="store_true",
                    help="each server on a host of its own: a network namespace reached over a veth (needs root)")
    ap.add_argument("--out", default="bench/results/routing")
    args = ap.parse_args(argv)
    model = serving_checkpoint() if args.model == "serving" else CHECKPOINTS[args.model]()
    convs = conversations(args.conversations, args.turns, args.system_prompts, args.system_words)
    flags = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "2048"]
    rows = []
    for name in args.configs.split(","):
        if name.rstrip("0123456789") not in ("one", "dp", "rr", "ca"):
            raise SystemExit(f"unknown config {name!r}: one, dpN, rrN or caN")
        print(f"running {name} ...", flush=True)
        rows.append(run_config(name, model, convs, args.max_tokens, flags, args.across_namespaces))
    _print(rows)
    save_rows(args.out, "routing", args, rows, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
