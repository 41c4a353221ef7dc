"""Interleaved A/B of the scheduler's plan and update times: this tree against git revisions.

    python -m noria.bench.scheduler_ab --revs 0867a5f [--sizes 256,1024] [--rounds 60] [--cpu]

Each revision's `scheduler/` is exported with `git archive` into a temporary package (its
imports renamed) and loaded beside this tree's in one process; every scheduler gets the
`noria bench scheduler` set-up (N running, 128-token prompts, pure decode) and they take
turns, 4 steps each, so that a busy machine slows all of them alike. Plan = `schedule()`,
update = `update_from_result()` + `take_updates()` (the fake worker's result is built
outside the timing). `--cpu` times with the thread's CPU clock instead of the wall clock.
`--check N` first runs N random workloads (preemption, swap, prefix caching, aborts, stop
tokens) through every scheduler and asserts identical plans and updates.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from noria.protocol.codec import Codec
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import SamplingParams
from noria.protocol.step import StepResult
from noria.protocol.worker_link import SchedulerToWorker

ROOT = Path(__file__).resolve().parent.parent


def load_revision(rev: str, where: Path) -> ModuleType:
    """`scheduler/` of `rev` as the package `noria_sched_<rev>`; its scheduler module."""
    name = f"noria_sched_{rev.replace('-', '_').replace('.', '_')}"
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "scheduler"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=tar.stdout, check=True)
    (where / "scheduler").rename(where / name)
    for f in (where / name).glob("*.py"):
        f.write_text(f.read_text().replace("noria.scheduler.", f"{name}."))
    sys.path.insert(0, str(where))
    return importlib.import_module(f"{name}.scheduler")


def build(mod: ModuleType, n: int, steps: int) -> object:
    cfg = EngineConfig(block_size=16, max_num_seqs=n, max_num_batched_tokens=max(2048, n * 2))
    s = mod.Scheduler(cfg, n * (128 + steps + 64) // 16 + 64, 4096)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(n):
        s.add_request(EngineRequest(i, [(i * 7 + j) % 30000 for j in range(128)], params, [2]))
    return s


def step(s: object, clock: object) -> tuple[float, float]:
    t0 = clock()
    plan = s.schedule()
    t1 = clock()
    ids = [rid for rid, _ in plan.scheduled]
    result = StepResult(plan.step_id, ids, [5] * len(ids))
    t2 = clock()
    s.update_from_result(result)
    s.take_updates()
    return t1 - t0, clock() - t2


def timing(mods: dict[str, ModuleType], sizes: list[int], rounds: int, clock: object) -> None:
    print(f"{'running':>8} {'version':>12} {'plan ms':>9} {'update ms':>10} {'sum ms':>8}")
    for n in sizes:
        ss = {k: build(m, n, rounds * 4 * 2) for k, m in mods.items()}
        for s in ss.values():
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
                step(s, clock)
        res: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ss}
        for _ in range(rounds):
            for k, s in ss.items():
                for _ in range(4):
                    p, u = step(s, clock)
                    res[k][0].append(p * 1e3)
                    res[k][1].append(u * 1e3)
        for k, (p, u) in res.items():
            mp, mu = statistics.median(p), statistics.median(u)
            print(f"{n:>8} {k:>12} {mp:>9.3f} {mu:>10.3f} {mp + mu:>8.3f}")


def check(mods: dict[str, ModuleType], seed: int) -> int:
    """Random workload through every scheduler: identical plans and updates; steps run."""
    from noria.bench.fake_worker import FakeWorker

    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    cfg = EngineConfig(block_size=bs, max_num_batched_tokens=rng.choice([6, 16, 64, 512]),
                       max_num_seqs=rng.randint(2, 40), preemption_mode=rng.choice(["swap", "recompute"]),
                       enable_prefix_caching=rng.random() < 0.6)
    nb, cpu = rng.randint(8, 120), rng.randint(0, 60)
    scheds = [m.Scheduler(cfg, nb, 400, cpu) for m in mods.values()]
    workers = [FakeWorker(nb, bs, vocab=50, num_cpu_blocks=cpu) for _ in scheds]
    codec: Codec = Codec(SchedulerToWorker)
    rid, live, steps = 0, set(), 0
    for _ in range(300):
        r = rng.random()
        if r < 0.25:
            p = SamplingParams(max_tokens=rng.randint(1, 40), min_tokens=rng.choice([0, 0, 3]),
                               stop_token_ids=rng.choice([None, [7, 9]]), ignore_eos=rng.random() < 0.3)
            msg = EngineRequest(rid, [rng.randint(0, 48) for _ in range(rng.randint(1, 60))], p, [49],
                                rng.randint(0, 2), None)
            for s in scheds:
                s.add_request(msg)
            live.add(rid)
            rid += 1
        elif r < 0.3 and live:
            victim = rng.choice(sorted(live))
            for s in scheds:
                s.abort([victim])
        elif scheds[0].has_work():
            plans = [s.schedule() for s in scheds]
            assert len({codec.encode(p) for p in plans}) == 1, f"seed {seed} step {steps}: plans differ"
            for s, w, p in zip(scheds, workers, plans, strict=True):
                s.update_from_result(w.execute(p))
            steps += 1
        ups = [s.take_updates() for s in scheds]
        assert all(u == ups[0] for u in ups), f"seed {seed}: updates differ"
        live -= {u.req_id for u in ups[0] if u.finish_reason}
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.scheduler_ab")
    ap.add_argument("--revs", default="0867a5f", help="comma-separated git revisions to compare with")
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--cpu", action="store_true", help="thread CPU time instead of wall time")
    ap.add_argument("--check", type=int, default=0, help="random workloads that must plan identically first")
    args = ap.parse_args(argv)
    import noria.scheduler.scheduler as this

    with tempfile.TemporaryDirectory() as tmp:
        mods = {rev: load_revision(rev, Path(tmp)) for rev in args.revs.split(",")}
        mods["this tree"] = this
        if args.check:
            print(f"identical plans and updates over {sum(check(mods, sd) for sd in range(args.check))} steps")
        timing(mods, [int(x) for x in args.sizes.split(",")], args.rounds,
               time.thread_time if args.cpu else time.perf_counter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
