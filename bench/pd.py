"""`noria bench pd`: prefill/decode disaggregation against mixed engines, long prompts arriving.

`--streams` clients each send short prompts one after another and stream `--decode-tokens`
tokens of each, while `--long` long prompts (`--long-words` words, `--long-tokens` tokens out)
arrive one every `--interval` seconds. The same requests run against each configuration, on
fresh servers that split this host's cores between them (--num-threads):

  mixed2  two `noria serve` behind vllm-router, round-robin: each engine prefills and decodes;
  pd2     a producer and a consumer (`--kv-transfer-config`) behind vllm-router's
          `--vllm-pd-disaggregation`: the consumer only decodes, the prompts' KV is pulled.

Reported: the streams' inter-token latency (the gap between consecutive streamed chunks)
p50/p90/p99/max, which long prompts arriving on the same engine stretch and PD exists to
keep short; the long prompts' TTFT p50/p99; the streams' output tokens/s; for pd2 the KV bytes
the consumer pulled and the seconds its pulls took. Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from noria.bench.plots import pyplot, save_rows
from noria.bench.routing import WORDS, _cpus, _metric, _post, vllm_router
from noria.bench.serving import summary
from noria.bench.serving_http import _tokens_in
from noria.bench.workloads import CHECKPOINTS, serving_checkpoint
from noria.frontend.local_server import LocalServer
from noria.protocol.sockets import free_tcp_port

CONFIGS = ("mixed2", "pd2")


def prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]


async def _one(http: Any, url: str, prompt: str, max_tokens: int) -> list[float]:
    """The arrival time of each streamed chunk that carried tokens, after the send time."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "logprobs": 1}
    times = [time.perf_counter()]
    async with http.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            chunk = line.startswith(b"data: ") and not line.startswith(b"data: [DONE]")
            if chunk and any(_tokens_in(c) for c in json.loads(line[6:]).get("choices", [])):
                times.append(time.perf_counter())
    return times


async def drive(url: str, short: list[str], long: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async def stream(i: int) -> tuple[list[float], int]:
            gaps, tokens, k = [], 0, 0
            while not done.is_set():
                times = await _one(http, url, short[(i + k * args.streams) % len(short)], args.decode_tokens)
                k += 1
                gaps += [b - a for a, b in zip(times[1:], times[2:], strict=False)]
                tokens += len(times) - 1
            return gaps, tokens

        async def arrivals() -> list[float]:
            async def one_long(p: str) -> float:
                times = await _one(http, url, p, args.long_tokens)
                return times[1] - times[0]

            tasks = []
            for p in long:
                await asyncio.sleep(args.interval)
                tasks.append(asyncio.create_task(one_long(p)))
            ttft = await asyncio.gather(*tasks)
            done.set()
            return list(ttft)

        start = time.perf_counter()
        streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
        ttft = await arrivals()
        results = await asyncio.gather(*streams)
        span = time.perf_counter() - start
    gaps = [g for gs, _ in results for g in gs]
    return {"itl_ms": {**summary(gaps), "max": max(gaps, default=0.0) * 1000}, "long_ttft_ms": summary(ttft),
            "stream_tok_s": sum(t for _, t in results) / span, "seconds": span}


def run_config(name: str, model: Path, short: list[str], long: list[str], args: argparse.Namespace) -> dict:
    threads = str(max(1, _cpus() // 2))
    flags = ["--model", str(model), "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
             str(args.max_model_len), "--num-threads", threads]
    if name == "pd2":
        producer = json.dumps({"kv_connector": "NoriaConnector", "kv_role": "kv_producer", "kv_port": free_tcp_port()})
        consumer = json.dumps({"kv_connector": "NoriaConnector", "kv_role": "kv_consumer"})
        engines = [LocalServer(*flags, "--kv-transfer-config", producer),
                   LocalServer(*flags, "--kv-transfer-config", consumer)]
        router_args = ["--vllm-pd-disaggregation", "--prefill", engines[0].http, "--decode", engines[1].http]
    else:
        engines = [LocalServer(*flags) for _ in range(2)]
        router_args = ["--policy", "round_robin", "--worker-urls", *[e.http for e in engines]]
    try:
        for e in engines:
            e.wait(timeout=300, http=True)
        with vllm_router(router_args) as url:
            for _ in range(2):  # both engines warm (round-robin sends one to each)
                _post(f"{url}/v1/completions", {"prompt": "warm up", "max_tokens": 2})
            row = asyncio.run(drive(url, short, long, args))
        if name == "pd2":
            row["kv_pull_mb"] = _metric(engines[1].http, "noria_kv_pull_bytes_total") / 1e6
            row["kv_pull_s"] = _metric(engines[1].http, "noria_kv_pull_seconds_total")
    finally:
        for e in engines:
            e.stop()
    return {"config": name, **row}


def _print(rows: list[dict]) -> None:
    f = lambda d: f"{d['p50']:.0f}/{d['p90']:.0f}/{d['p99']:.0f}/{d['max']:.0f}"  # noqa: E731
    g = lambda d: f"{d['p50']:.0f}/{d['p99']:.0f}"  # noqa: E731
    print(f"\n{'config':<8} {'stream ITL p50/p90/p99/max ms':>30} {'long TTFT p50/p99 ms':>21} {'stream tok/s':>12} "
          f"{'KV pulled':>14}")
    for r in rows:
        pulled = f"{r['kv_pull_mb']:.1f} MB {r['kv_pull_s']:.2f} s" if "kv_pull_mb" in r else "-"
        print(f"{r['config']:<8} {f(r['itl_ms']):>30} {g(r['long_ttft_ms']):>21} {r['stream_tok_s']:>12.1f} "
              f"{pulled:>14}")


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, p in enumerate(("p50", "p90", "p99", "max")):
        ax.bar([j + i * 0.2 for j in range(len(rows))], [r["itl_ms"][p] for r in rows], 0.2, label=f"ITL {p}")
    ax.set_xticks([j + 0.3 for j in range(len(rows))], [r["config"] for r in rows])
    ax.set_ylabel("ms between streamed chunks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--streams", type=int, default=4, help="clients streaming short requests")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each short request streams")
    ap.add_argument("--long", type=int, default=8, help="long prompts sent")
    ap.add_argument("--long-words", type=int, default=700)
    ap.add_argument("--long-tokens", type=int, default=4)
    ap.add_argument("--interval", type=float, default=1.5, help="seconds between long prompts")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model", choices=sorted(CHECKPOINTS), default="serving")
    ap.add_argument("--out", default="bench/results/pd")
    args = ap.parse_args(argv)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}: {', '.join(CONFIGS)}")
    model = serving_checkpoint() if args.model == "serving" else CHECKPOINTS[args.model]()
    short, long = prompts(64, 20, seed=1), prompts(args.long, args.long_words, seed=2)
    rows = []
    for name in args.configs.split(","):
        print(f"running {name} ...", flush=True)
        rows.append(run_config(name, model, short, long, args))
    _print(rows)
    save_rows(args.out, "pd", args, rows, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
