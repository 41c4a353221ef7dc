"""`noria bench failover`: what a worker crash costs a serving engine.

One `noria serve` (local worker) streams the same greedy workload in rounds. The first
round is undisturbed; in each later round the worker is SIGKILLed once the streams have
produced a given share of their tokens. Reported per kill: the time from the SIGKILL to
the first token the new worker makes (detection + restart + model load + recompute of
the re-queued requests' tokens), the seconds the engine had no live worker, the
requests re-queued and the tokens recomputed; and whether every disturbed round's output equals the undisturbed one. From
the undisturbed round: the bytes per step on the plan and result links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from noria import AsyncClient, Client, SamplingParams
from noria.frontend.local_server import LocalServer, child_pids
from noria.protocol.client import Delta, Done, SchedulerStats


class Round:
    """One round's streams: each request's token ids, and the arrival time of every delta."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.arrivals: list[float] = []


async def _stream(address: str, prompts: list[str], params: SamplingParams, out: Round) -> None:
    async with AsyncClient(address, timeout=300) as client:

        async def one(i: int) -> None:
            async for msg in client.stream(prompts[i], params):
                if isinstance(msg, Delta):
                    out.tokens[i] += msg.token_ids
                    out.arrivals.append(time.monotonic())
                elif isinstance(msg, Done):
                    out.reasons[i] = msg.finish_reason

        await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _stats(address: str) -> SchedulerStats:
    with Client(address, timeout=30) as c:
        return c.stats().stats


def _worker_pid(server_pid: int) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = child_pids(server_pid, b"noria.worker")
        if pids:
            return pids[0]
        time.sleep(0.05)  # poll interval; the deadline bounds the wait
    raise TimeoutError("no worker process came up")


def _kill_at(server_pid: int, out: Round, deltas: int, killed: list[float]) -> threading.Thread:
    def run() -> None:
        while len(out.arrivals) < deltas:
            time.sleep(0.005)  # poll interval: the round ends long before any deadline matters
        os.kill(_worker_pid(server_pid), signal.SIGKILL)
        killed.append(time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _first_token_after(kill: float, arrivals: list[float]) -> float:
    """Seconds from the SIGKILL to the first token the new worker made. Deltas of steps that
    finished before the kill may still be on their way to the client just after it, so the
    recovered stream starts after the longest silence that follows the kill."""
    times = [kill, *sorted(t for t in arrivals if t > kill)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return times[gaps.index(max(gaps)) + 1] - kill if gaps else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench failover")
    ap.add_argument("--model", default="demo", help="a checkpoint folder, or demo")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--kills", type=int, default=3, help="disturbed rounds, one SIGKILL each")
    ap.add_argument("--at", type=float, default=0.4, help="kill once this share of the tokens has streamed")
    ap.add_argument("--out", default="bench/results/failover")
    args = ap.parse_args(argv)
    prompts = [f"Request {i} asks the water wheel about the river and its buckets" for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    total = args.num_requests * args.max_tokens
    flags = ("--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.num_requests))
    rows = []
    with LocalServer(*flags) as server:
        server.wait(300)
        before = _stats(server.address)
        calm = Round(len(prompts))
        t0 = time.monotonic()
        asyncio.run(_stream(server.address, prompts, params, calm))
        calm_seconds = time.monotonic() - t0
        after = _stats(server.address)
        steps = max(1, after.num_steps - before.num_steps)
        plan_b = (after.plan_bytes - before.plan_bytes) / steps
        result_b = (after.result_bytes - before.result_bytes) / steps
        for k in range(args.kills):
            s0 = _stats(server.address)
            hurt, killed = Round(len(prompts)), []
            killer = _kill_at(server.proc.pid, hurt, int(total * args.at), killed)
            t0 = time.monotonic()
            asyncio.run(_stream(server.address, prompts, params, hurt))
            seconds = time.monotonic() - t0
            killer.join(10)
            s1 = _stats(server.address)
            rows.append({
                "kill": k + 1, "recovery_s": _first_token_after(killed[0], hurt.arrivals), "round_s": seconds,
                "no_worker_s": s1.seconds_without_worker - s0.seconds_without_worker,
                "requests_requeued": s1.requests_requeued - s0.requests_requeued,
                "tokens_recomputed": s1.tokens_recomputed - s0.tokens_recomputed,
                "identical": hurt.tokens == calm.tokens and all(r == "length" for r in hurt.reasons),
            })
    print(f"\nfailover: {args.num_requests} streams x {args.max_tokens} tokens, model {args.model}, "
          f"{os.cpu_count()} cores; undisturbed round {calm_seconds:.1f} s")
    print(f"{'kill':>4} {'SIGKILL->next token s':>22} {'no worker s':>12} {'round s':>8} {'requeued':>9} "
          f"{'recomputed':>11} {'identical':>10}")
    for r in rows:
        print(f"{r['kill']:>4} {r['recovery_s']:>22.2f} {r['no_worker_s']:>12.2f} {r['round_s']:>8.1f} {r['requests_requeued']:>9} "
              f"{r['tokens_recomputed']:>11} {r['identical']!s:>10}")
    if rows:
        print(f"median SIGKILL -> next token: {statistics.median(r['recovery_s'] for r in rows):.2f} s")
    print(f"bytes per step: plan {plan_b:.0f}, result {result_b:.0f} ({steps} steps, undisturbed round)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"calm_seconds": calm_seconds, "plan_bytes_per_step": plan_b, "result_bytes_per_step": result_b,
               "kills": rows}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
