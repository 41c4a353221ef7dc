"""`noria bench overload --seconds 120`: ten times the engine's capacity, and memory stays flat.

`--factor` x `--max-num-seqs` clients (several ZMQ connections) each send a
request, wait for its end, and send the next; a refused one (`overloaded`)
waits the server's Retry-After (1 s) and tries again. Every process of
`noria serve` (frontend, scheduler, worker, bridge) has its RSS sampled each
second. Passes when every accepted request finished with all its tokens and no
process's RSS grew, from the end of the warm-up (the first 10% of the run) to
the end, by more than 10% + 32 MiB (the documented bound, docs/protocol.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from typing import Any

from noria.bench.process_rss import MiB, rss_bytes, server_processes
from noria.frontend.client import AsyncClient
from noria.frontend.local_server import LocalServer
from noria.protocol.errors import NoriaError
from noria.protocol.sampling import SamplingParams

MAX_TOKENS = 32
GROWTH_FRACTION, GROWTH_SLACK_MIB = 0.10, 32


def rss_mib(pid: int) -> float:
    return rss_bytes(pid) / MiB


def process_tree(pid: int) -> dict[str, int]:
    """The serve process and its children, by role (bench/process_rss.py)."""
    return server_processes(pid, depth=1)


async def flood(address: str, clients: int, seconds: float, connections: int) -> Counter[str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    counts: Counter[str] = Counter()
    stop = time.monotonic() + seconds
    conns = [AsyncClient(address, timeout=300) for _ in range(connections)]

    async def client(c: AsyncClient, i: int) -> None:
        while time.monotonic() < stop:
            try:
                out = await c.generate([1, 17, 42, i % 97], params)
            except NoriaError as e:
                counts[e.code] += 1
                if e.code != "overloaded":
                    raise
                await asyncio.sleep(1.0)  # the bridge's Retry-After
                continue
            counts["finished"] += 1
            if len(out.outputs[0].token_ids) != MAX_TOKENS:
                counts["short"] += 1

    try:
        await asyncio.gather(*(client(conns[i % connections], i) for i in range(clients)))
    finally:
        for c in conns:
            c.close()
    return counts


async def run(address: str, pid: int, clients: int, seconds: float, connections: int) -> dict[str, Any]:
    procs = process_tree(pid)
    samples: dict[str, list[float]] = {name: [] for name in procs}
    task = asyncio.get_running_loop().create_task(flood(address, clients, seconds, connections))
    while not task.done():
        for name, p in procs.items():
            samples[name].append(rss_mib(p))
        await asyncio.wait([task], timeout=1.0)
    counts = task.result()
    report: dict[str, Any] = {"clients": clients, "seconds": seconds, "answers": dict(counts), "rss_mib": {}}
    ok = counts["short"] == 0 and counts["finished"] > 0
    for name, series in samples.items():
        warm = series[max(1, len(series) // 10)] if len(series) > 1 else series[0]
        peak, end = max(series), series[-1]
        bound = warm * (1 + GROWTH_FRACTION) + GROWTH_SLACK_MIB
        report["rss_mib"][name] = {"after_warmup": round(warm, 1), "peak": round(peak, 1), "end": round(end, 1),
                                   "bound": round(bound, 1)}
        ok = ok and end <= bound
    report["ok"] = ok
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench overload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--factor", type=int, default=10, help="clients per sequence the engine runs at once")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-queued-requests", type=int, default=32)
    ap.add_argument("--connections", type=int, default=8, help="ZMQ connections the clients share")
    args = ap.parse_args(argv)
    flags = ["--num-kv-blocks", "256", "--max-model-len", "128", "--max-num-seqs", str(args.max_num_seqs),
             "--max-queued-requests", str(args.max_queued_requests)]
    with LocalServer(*flags) as server:
        server.wait(http=True)
        report = asyncio.run(run(server.address, server.proc.pid, args.factor * args.max_num_seqs, args.seconds,
                                 args.connections))
    print(json.dumps(report, indent=1))
    print(f"overload x{args.factor}: {report['answers'].get('finished', 0)} finished, "
          f"{report['answers'].get('overloaded', 0)} refused; RSS within bound: {report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
