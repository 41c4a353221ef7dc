"""`noria bench scheduler`: time to plan one step with N running requests; with `--engine`,
W1 through the whole engine with async scheduling off and on, interleaved.

The scheduler runs alone (no worker): each step is planned, encoded as the
StepPlan the worker would receive, and answered with one sampled token per
sequence. Reported per step: plan (schedule()), encode (msgpack), update
(update_from_result()), as medians over the measured steps. Target: plan
under 0.5 ms at 256 running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from noria.protocol.codec import Codec
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.model_spec import read_spec
from noria.protocol.sampling import EngineSamplingParams, SamplingParams
from noria.protocol.step import StepResult
from noria.protocol.worker_link import SchedulerToWorker
from noria.scheduler.scheduler import Scheduler


def measure(num_running: int, num_waiting: int, steps: int) -> dict[str, float]:
    cfg = EngineConfig(block_size=16, max_num_seqs=num_running, max_num_batched_tokens=max(2048, num_running * 2))
    prompt_len = 128
    blocks = num_running * (prompt_len + steps + 64) // 16 + 64
    s = Scheduler(cfg, blocks, 4096)
    params = EngineSamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(num_running + num_waiting):
        s.add_request(EngineRequest(i, [(i * 7 + j) % 30000 for j in range(prompt_len)], params, [2]))
    codec: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)

    def one_step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        plan = s.schedule()
        t1 = time.perf_counter()
        codec.encode(plan)
        t2 = time.perf_counter()
        ids = [rid for rid, _ in plan.scheduled]
        result = StepResult(plan.step_id, ids, [5] * len(ids))  # the worker's part: not timed
        t2b = time.perf_counter()
        s.update_from_result(result)
        s.take_updates()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2b

    # Warm up until every running request is past its prompt (pure decode steps).
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running) or len(s.running) < num_running:
        one_step()
    samples = [one_step() for _ in range(steps)]
    assert len(s.running) == num_running
    ms = [[x * 1e3 for x in col] for col in zip(*samples, strict=True)]
    return {
        "running": num_running, "waiting": num_waiting,
        "plan_ms": statistics.median(ms[0]), "encode_ms": statistics.median(ms[1]),
        "update_ms": statistics.median(ms[2]), "plan_p99_ms": sorted(ms[0])[int(0.99 * (len(ms[0]) - 1))],
    }


def _cpu_seconds(module: str) -> float:
    """CPU seconds so far of this process's children running `python -m <module>` (Linux)."""
    total, me, tick = 0.0, str(os.getpid()), os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if stat[1] == me and module in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                total += (int(stat[11]) + int(stat[12])) / tick
        except OSError:
            continue
    return total


def engine_ab(model: str, num_requests: int, max_tokens: int | None, rounds: int, dtype: str = "auto") -> list[dict]:
    """W1 (greedy, EOS ignored) through `LLM`, async scheduling off then on, `rounds` times;
    each run its own engine in this process tree. Token ids must agree across every run. The
    worker's step log splits each run's wall time into the forward passes and the rest (the
    engine's work around them: on a host whose cores the forward keeps busy, every process's)."""
    import tempfile

    from noria import LLM
    from noria.bench import step_log
    from noria.bench.ceiling import count_steps, read_steps, recorded_model_seconds
    from noria.bench.workloads import CHECKPOINTS, w1
    from noria.frontend.gguf_view import gguf_view

    path = str(CHECKPOINTS[model]()) if model in CHECKPOINTS else model
    vocab = read_spec(gguf_view(path) if path.endswith(".gguf") else path).vocab_size
    work = [(p, min(m, max_tokens or m)) for p, m in w1(vocab, num_requests)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    rows, first = [], None
    record = str(Path(tempfile.mkdtemp(prefix="noria-sched-ab-")) / "steps.jsonl")
    for r in range(rounds):
        for ahead in (False, True):
            with step_log.recording(record), LLM(path, num_kv_blocks=4096, async_scheduling=ahead, dtype=dtype) as llm:
                llm.generate([work[0][0]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
                warm = count_steps(record)
                cpu0 = _cpu_seconds("noria.scheduler"), _cpu_seconds("noria.worker")
                t0 = time.perf_counter()
                outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
                dt = time.perf_counter() - t0
                cpu = _cpu_seconds("noria.scheduler") - cpu0[0], _cpu_seconds("noria.worker") - cpu0[1]
                st = llm.stats()
            ran = read_steps(record, warm)  # the steps that ran the model
            forward = recorded_model_seconds(ran)
            ids = [o.outputs[0].token_ids for o in outs]
            first = first or ids
            same = sum(a == b for a, b in zip(ids, first, strict=True))
            # Every run plans the same tokens, but its steps' batches differ (how many requests have
            # arrived when the first step is planned; with async scheduling, who waits for a token
            # on its way), so prompts are cut into other chunks and some sums are taken in another
            # order; in 16 bits near-ties of random weights may then flip. In float32 every token
            # must agree.
            if dtype in ("auto", "float32") and not path.endswith(".gguf"):
                assert same == len(ids), "async scheduling changed the greedy output"
            if same < len(ids):
                print(f"greedy outputs identical to the first run's in {same} of {len(ids)} requests", flush=True)
            n = sum(map(len, ids))
            rows.append({"round": r, "async_scheduling": ahead, "seconds": dt, "output_tokens": n,
                         "tok_per_s": n / dt, "forward_s": forward, "steps": st.num_steps,
                         "steps_planned_ahead": st.steps_planned_ahead, "tokens_discarded": st.tokens_discarded,
                         "scheduler_cpu_s": cpu[0], "worker_cpu_s": cpu[1]})
            print(f"round {r} async {'on ' if ahead else 'off'}: {dt:7.2f} s  {n / dt:7.1f} tok/s  "
                  f"{st.num_steps} steps ({st.steps_planned_ahead} planned ahead, "
                  f"{st.tokens_discarded} tokens discarded); per model step: {dt / len(ran) * 1e3:.2f} ms, "
                  f"forward {forward / len(ran) * 1e3:.2f}, the rest {(dt - forward) / len(ran) * 1e3:.2f}; "
                  f"CPU s: scheduler {cpu[0]:.2f}, worker {cpu[1]:.2f}", flush=True)
    for ahead in (False, True):
        secs = [x["seconds"] for x in rows if x["async_scheduling"] == ahead]
        print(f"async {'on ' if ahead else 'off'}: median {statistics.median(secs):.2f} s over {len(secs)} runs")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench scheduler")
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--engine", action="store_true", help="W1 through the engine, async scheduling off/on")
    ap.add_argument("--model", default="small", help="with --engine: small, serving, or a checkpoint folder")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=None, help="with --engine: cap every output")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="with --engine: the engine's --dtype")
    args = ap.parse_args(argv)
    if args.engine:
        out = engine_ab(args.model, args.num_requests, args.max_tokens, args.rounds, args.dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for waiting in (0, n):
            rows.append(measure(n, waiting, args.steps))
    print(f"{'running':>8} {'waiting':>8} {'plan ms':>9} {'plan p99':>9} {'encode ms':>10} {'update ms':>10}")
    for r in rows:
        print(f"{r['running']:>8} {r['waiting']:>8} {r['plan_ms']:>9.3f} {r['plan_p99_ms']:>9.3f} "
              f"{r['encode_ms']:>10.3f} {r['update_ms']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
