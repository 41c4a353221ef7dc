"""`noria bench soak --minutes 60`: mixed traffic at ~80% of capacity; memory flat, nothing lost.

One `noria serve` on the demo model with a small KV cache (preemption happens). Each
job's output is measured first (soak_jobs). A warm-up then runs the traffic closed-loop
at full concurrency to measure the engine's capacity in requests/s; for `--minutes`
after it, requests arrive as a Poisson process at `--load` x that capacity, spread
over raw ZMQ DEALERs, noria's AsyncClient, websockets, OpenAI SSE streams and
non-streaming HTTP, with greedy, long, n=2 sampled and stop-string jobs; some streams
are aborted (or their connection cut) after a few deltas. Every second or so each
process's RSS (frontend, bridge, scheduler, worker) and the engine's stats are sampled.

Reported, and the exit status is 0 only if all hold: every process's RSS after the
warm-up (the capacity phase plus the first tenth of the paced run) changes by at most
`--rss-tolerance` (5%) to the end; no request lost (each ends with exactly one final
message) or duplicated; every stream's deltas concatenate to the job's final text (an
aborted one to a prefix of it) and its token count equals the usage; preemption
happened; at the end the engine is idle, KV usage 0 and the block check consistent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import websockets
import zmq.asyncio

from noria.bench.overload import process_tree, rss_mib
from noria.bench.soak_jobs import Job, Outcome, choose
from noria.bench.soak_report import plot, print_report, rss_drift
from noria.bench.soak_surfaces import (
    STREAMING,
    SURFACES,
    WsConn,
    ZmqConn,
    build_jobs,
    run_client,
    run_http,
    run_sse,
)
from noria.frontend.client import AsyncClient
from noria.frontend.local_server import LocalServer
from noria.protocol.client import SchedulerStats
from noria.protocol.errors import NoriaError

CONNECTIONS = 2  # raw DEALERs and websockets, each carrying many requests
REQUEST_TIMEOUT = 600.0  # s without a final message before a request counts as lost (a shared machine stalls)


class Traffic:
    """The clients of every surface, and every request's outcome."""

    def __init__(self, address: str, http: str, jobs: list[Job], seed: int, abort_share: float) -> None:
        self.address, self.http, self.jobs = address, http, jobs
        self.rng = random.Random(seed)
        self.abort_share = abort_share
        self.outcomes: list[Outcome] = []
        self.in_flight = 0

    async def __aenter__(self) -> Traffic:
        self.ctx = zmq.asyncio.Context()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
                                             connector=aiohttp.TCPConnector(limit=0))
        self.client = AsyncClient(self.address, timeout=REQUEST_TIMEOUT)
        ws_url = self.http.replace("http://", "ws://") + "/v1/stream"
        self.zmq = [ZmqConn(self.ctx, self.address) for _ in range(CONNECTIONS)]
        self.ws = [WsConn(await websockets.connect(ws_url, max_size=None)) for _ in range(CONNECTIONS)]
        self.readers = [asyncio.ensure_future(c.read()) for c in (*self.zmq, *self.ws)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for r in self.readers:
            r.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        for w in self.ws:
            await w.ws.close()
        self.client.close()
        await self.session.close()
        self.ctx.destroy(0)

    @property
    def stray(self) -> int:
        return sum(c.stray for c in (*self.zmq, *self.ws))

    async def one(self) -> Outcome:
        """Pick a surface, a job and maybe an abort; run it to its end."""
        rng = self.rng
        surface = rng.choices(list(SURFACES), weights=list(SURFACES.values()))[0]
        job = choose(rng, self.jobs)
        abort = rng.randint(1, 8) if surface in STREAMING and rng.random() < self.abort_share else None
        self.in_flight += 1
        try:
            if surface in ("zmq", "ws"):
                conn = rng.choice(self.zmq if surface == "zmq" else self.ws)
                o = await conn.run(job, abort, REQUEST_TIMEOUT)
            elif surface == "client":
                o = await run_client(self.client, job, abort, REQUEST_TIMEOUT)
            elif surface == "sse":
                o = await run_sse(self.session, self.http, job, abort)
            else:
                o = await run_http(self.session, self.http, job)
        except Exception as e:  # noqa: BLE001 - whatever it is, it is this request's error, counted and shown
            o = Outcome.new(surface, job, abort)
            o.final(None, None, f"client saw {type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1
        o.settle()
        self.outcomes.append(o)
        return o


async def closed_loop(traffic: Traffic, concurrency: int, seconds: float) -> float:
    """Requests/s with `concurrency` clients each sending its next request when the last ends."""
    t0 = time.monotonic()
    stop, done = t0 + seconds, 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await traffic.one()
            done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


async def burst(traffic: Traffic, n: int) -> int:
    """`n` requests at once, so that every process meets its largest queue before the baseline.

    Memory that a process keeps from its largest backlog (the bridge's per-connection objects,
    Python's allocator) is a high-water mark, not a leak: without this, the first random spell of
    queueing in the paced run would read as drift. Returns the most in flight."""
    peak = 0

    async def one() -> None:
        nonlocal peak
        peak = max(peak, traffic.in_flight + 1)
        await traffic.one()

    await asyncio.gather(*(one() for _ in range(n)))
    return peak


async def paced(traffic: Traffic, rate: float, seconds: float, rng: random.Random) -> int:
    """Poisson arrivals at `rate`/s for `seconds`; waits for the last to end. Returns the most in flight."""
    tasks: set[asyncio.Task[Outcome]] = set()
    t0 = time.monotonic()
    due, peak = t0, 0
    while (due := due + rng.expovariate(rate)) < t0 + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        task = asyncio.ensure_future(traffic.one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        peak = max(peak, traffic.in_flight)
    if tasks:
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT + 30)
    return peak


class Sampler:
    """Each process's RSS and the engine's load, every `interval` s, from the server being ready."""

    def __init__(self, address: str, pid: int, interval: float) -> None:
        self.address, self.pid, self.interval = address, pid, interval
        self.t0 = time.monotonic()
        self.s: dict[str, Any] = {"t": [], "rss_mib": {}, "kv_cache_usage": [], "running": [], "waiting": [],
                                  "loadavg": []}

    async def run(self) -> None:
        async with AsyncClient(self.address, timeout=30) as ac:
            while True:
                t = time.monotonic() - self.t0
                procs = process_tree(self.pid)  # again each time: a restarted process is followed
                try:
                    st = (await ac.stats()).stats
                except NoriaError:  # a stalled answer costs one load sample, never the RSS series
                    st = SchedulerStats(num_running=-1, num_waiting=-1, kv_cache_usage=-1.0)
                s = self.s
                n = len(s["t"])
                s["t"].append(round(t, 2))
                for name, p in procs.items():
                    s["rss_mib"].setdefault(name, [0.0] * n).append(round(rss_mib(p), 2))
                for series in s["rss_mib"].values():
                    series.extend([0.0] * (n + 1 - len(series)))  # a process that is gone: 0
                s["kv_cache_usage"].append(round(st.kv_cache_usage, 4))
                s["running"].append(st.num_running)
                s["waiting"].append(st.num_waiting)
                s["loadavg"].append(os.getloadavg()[0])  # the machine is shared: how busy it was
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - self.t0 - t)))


async def wait_idle(address: str, bound: float = 120.0) -> tuple[float, Any]:
    """Seconds until the engine holds no request and no KV block, and its stats then."""
    t0 = time.monotonic()
    async with AsyncClient(address, timeout=30) as ac:
        while True:
            s = await ac.stats()
            st = s.stats
            idle = s.num_open_requests == 0 and st.num_running == st.num_waiting == st.num_swapped == 0
            if (idle and st.kv_cache_usage == 0 and st.num_free_blocks == st.num_kv_blocks) or \
                    time.monotonic() - t0 > bound:
                return time.monotonic() - t0, st
            await asyncio.sleep(0.2)  # poll interval; the bound limits the wait


def summarise(traffic: Traffic) -> tuple[dict[str, int], list[str]]:
    c: Counter[str] = Counter(requests=len(traffic.outcomes), stray=traffic.stray)
    examples: list[str] = []
    for o in traffic.outcomes:
        c["aborted"] += o.abort_after is not None and "abort" in o.reasons
        c["cut"] += o.cut
        for p in o.verdict():
            kind = "lost" if p.startswith("lost") else "duplicated" if p.startswith("duplicated") else \
                "errors" if p.startswith("error") else "mismatched"
            c[kind] += 1
            if len(examples) < 50:
                examples.append(f"{o.surface} {o.job.key} abort_after={o.abort_after}: {p}")
    for k in ("lost", "duplicated", "errors", "mismatched", "aborted", "cut"):
        c.setdefault(k, 0)
    return dict(c), examples


async def soak(server: LocalServer, args: argparse.Namespace) -> dict[str, Any]:
    sampler = Sampler(server.address, server.proc.pid, args.sample_interval)
    sampling = asyncio.ensure_future(sampler.run())
    async with aiohttp.ClientSession() as session:
        jobs = await build_jobs(server.address, server.http, session)
    async with Traffic(server.address, server.http, jobs, args.seed, args.abort_share) as traffic:
        capacity = await closed_loop(traffic, args.concurrency, args.warmup_seconds)
        burst_s = time.monotonic() - sampler.t0
        burst_peak = await burst(traffic, args.burst) if args.burst else 0
        warmup_requests = len(traffic.outcomes)
        warmup_s = time.monotonic() - sampler.t0
        rate = args.load * capacity
        peak = await paced(traffic, rate, args.minutes * 60, random.Random(args.seed + 1))
        end_s = time.monotonic() - sampler.t0
        await asyncio.sleep(1.0)  # a late duplicate of the last finals would arrive now
        idle_s, st = await wait_idle(server.address)
        counts, examples = summarise(traffic)
    sampling.cancel()
    await asyncio.gather(sampling, return_exceptions=True)
    paced_s = end_s - warmup_s
    settled = warmup_s + 0.1 * paced_s
    window = max(0.05 * paced_s, 3 * args.sample_interval)
    s = sampler.s
    rss = {name: rss_drift(s["t"], series, settled, end_s, window) for name, series in s["rss_mib"].items()}
    for name, series in s["rss_mib"].items():  # what the burst added, shown beside the drift
        before = [v for t, v in zip(s["t"], series, strict=True) if t <= burst_s and v > 0]
        rss[name]["before_burst_mib"] = before[-1] if before else None
    rss_flat = all(d["drift"] is not None and abs(d["drift"]) <= args.rss_tolerance for d in rss.values())
    engine = {"blocks_consistent": st.blocks_consistent, "kv_cache_usage": st.kv_cache_usage,
              "num_free_blocks": st.num_free_blocks, "num_kv_blocks": st.num_kv_blocks,
              "num_preemptions": st.num_preemptions, "generation_tokens": st.generation_tokens,
              "prompt_tokens": st.prompt_tokens, "idle_after_s": round(idle_s, 2)}
    engine_ok = st.blocks_consistent and st.kv_cache_usage == 0 and st.num_free_blocks == st.num_kv_blocks \
        and st.num_preemptions > 0
    requests_ok = all(counts[k] == 0 for k in ("lost", "duplicated", "errors", "mismatched", "stray"))
    return {
        "minutes": args.minutes, "load": args.load, "capacity_rps": round(capacity, 3), "rate_rps": round(rate, 3),
        "warmup_s": round(warmup_s, 1), "settled_s": round(settled, 1), "paced_s": round(paced_s, 1),
        "peak_in_flight": peak, "burst": args.burst, "burst_peak_in_flight": burst_peak,
        "warmup_requests": warmup_requests,
        "paced_requests": len(traffic.outcomes) - warmup_requests, "jobs": len(jobs), "server_flags": list(args.server_flags), "cpu": cpu_model(),
        "counts": counts, "by_surface": dict(Counter(o.surface for o in traffic.outcomes)),
        "by_variant": dict(Counter(o.job.variant for o in traffic.outcomes)), "engine": engine,
        "loadavg_1min": {"min": min(s["loadavg"], default=0), "median": statistics.median(s["loadavg"] or [0]),
                         "max": max(s["loadavg"], default=0)},
        "rss": rss, "rss_tolerance": args.rss_tolerance, "rss_flat": rss_flat, "requests_ok": requests_ok,
        "ok": rss_flat and requests_ok and engine_ok, "examples": examples, "samples": s,
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        name = platform.processor() or "unknown CPU"
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the paced run after the warm-up")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the measured capacity")
    ap.add_argument("--warmup-seconds", type=float, default=60.0, help="closed-loop capacity measurement")
    ap.add_argument("--concurrency", type=int, default=32, help="clients in the capacity measurement")
    ap.add_argument("--burst", type=int, default=1024,
                    help="requests sent at once at the end of the warm-up, before the RSS baseline (0: none)")
    ap.add_argument("--abort-share", type=float, default=0.15, help="share of streams aborted after a few deltas")
    ap.add_argument("--rss-tolerance", type=float, default=0.05, help="largest RSS drift after warm-up")
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="small, so that preemption happens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/soak", help="writes OUT.json and OUT.png")
    args = ap.parse_args(argv)
    args.server_flags = ("--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "512",
                         "--max-num-seqs", str(args.max_num_seqs))
    with LocalServer(*args.server_flags) as server:
        server.wait(300, http=True)
        report = asyncio.run(soak(server, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print_report(report)
    plot(report, out.with_suffix(".png"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
