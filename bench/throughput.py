"""`noria bench throughput`: offline W1 on the "small" model, every system in one run.

Systems (pick with --systems): hf-static-8/16/32 (HF `generate`, static
left-padded batches, each runs until its longest request; only requested
tokens count), hf-cb (HF continuous batching manager at its best CPU
settings), noria-llm (`LLM.generate`), noria-serve (`noria serve` + the
client library, all requests at once), ceiling (noria's recorded batch
shapes replayed as bare forward passes). Prints a table of output tokens/s
and ratios, writes JSON and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.workloads import small_checkpoint, w1

Work = list[tuple[list[int], int]]


def run_hf_static(path: Path, work: Work, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    counted = 0
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            longest = max(m for _, m in chunk)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
            counted += sum(m for _, m in chunk)
    dt = time.perf_counter() - t0
    return {"system": f"hf-static-{batch}", "seconds": dt, "output_tokens": counted}


def run_hf_cb(path: Path, work: Work, max_batch_tokens: int = 256, max_requests: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    t0 = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=m) for p, m in work]
    got = 0
    done: set[str] = set()
    while len(done) < len(ids):
        r = manager.get_result(timeout=1.0)
        if r is not None and r.is_finished():
            done.add(r.request_id)
            got += len(r.generated_tokens)
    dt = time.perf_counter() - t0
    manager.stop(block=True)
    return {"system": "hf-cb", "seconds": dt, "output_tokens": got,
            "settings": {"max_batch_tokens": max_batch_tokens, "max_requests_per_batch": max_requests}}


def run_noria_llm(path: Path, work: Work, flags: dict, record: str | None = None) -> dict:
    from noria import LLM, SamplingParams

    if record:
        os.environ["NORIA_RECORD_STEPS"] = record
    try:
        with LLM(str(path), **flags) as llm:
            llm.generate([work[0][0]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            warm = len(Path(record).read_text().splitlines()) if record else 0
            params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
            t0 = time.perf_counter()
            outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            stats = llm.stats()
    finally:
        os.environ.pop("NORIA_RECORD_STEPS", None)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    gen_steps = max(stats.num_steps - 1, 1)
    return {"system": "noria-llm", "seconds": dt, "output_tokens": n, "steps": stats.num_steps,
            "avg_running_batch": n / gen_steps, "record_skip": warm}


def run_noria_serve(path: Path, work: Work, flags: list[str]) -> dict:
    from noria import AsyncClient, SamplingParams
    from protocol.sockets import free_tcp_port
    from tests.procs import wait_ready

    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", "--model", str(path),
                             "--zmq-port", str(port), "--port", str(free_tcp_port()), *flags])
    address = f"tcp://127.0.0.1:{port}"
    try:
        wait_ready(address, proc, timeout=300)

        async def main() -> tuple[float, int]:
            async with AsyncClient(address, timeout=600) as c:
                await c.generate(work[0][0], SamplingParams(max_tokens=2))
                params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(c.generate(p, sp) for (p, _), sp in zip(work, params, strict=True)))
                return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

        dt, n = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)
    return {"system": "noria-serve", "seconds": dt, "output_tokens": n}


def run_ceiling(path: Path, record: str, flags: dict, skip: int) -> dict:
    from bench.ceiling import read_steps, replay
    from frontend.startup import make_config

    steps = read_steps(record, skip)
    dt = replay(make_config(str(path), **flags), steps)
    return {"system": "ceiling", "seconds": dt, "output_tokens": sum(n for _, _, n in steps), "steps": len(steps)}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["system"] for r in rows]
    vals = [r["tok_s"] for r in rows]
    ax.barh(names, vals, color=["#4c72b0" if n.startswith("noria") else "#999999" for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center")
    ax.set_xlabel("output tokens / s (W1, small model, CPU)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def run_one(name: str, args: argparse.Namespace, record: str, skip: int) -> dict:
    path = small_checkpoint()
    work = w1(num_requests=args.num_requests)
    flags = {"num_kv_blocks": args.num_kv_blocks}
    if name.startswith("hf-static-"):
        return run_hf_static(path, work, int(name.rsplit("-", 1)[1]))
    if name == "hf-cb":
        return run_hf_cb(path, work)
    if name == "noria-llm":
        return run_noria_llm(path, work, flags, record)
    if name == "noria-serve":
        return run_noria_serve(path, work, ["--num-kv-blocks", str(args.num_kv_blocks)])
    if name == "ceiling":
        return run_ceiling(path, record, flags, skip)
    raise SystemExit(f"unknown system {name!r}")


def run_isolated(name: str, argv: list[str], record: str, skip: int) -> dict:
    """Each system in its own process: its own threads, memory and OpenMP settings.
    The ceiling replays in the worker's setting (passive OpenMP waits), HF in torch's default."""
    env = dict(os.environ)
    if name == "ceiling":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "bench.throughput", *argv, "--one", name, "--record", record,
                        "--skip", str(skip), "--row", out.name], check=True, env=env)
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench throughput")
    ap.add_argument("--systems", default="hf-static-8,hf-static-16,hf-static-32,hf-cb,noria-llm,noria-serve,ceiling")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--out", default="bench/results/throughput")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run one system
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        row = run_one(args.one, args, args.record, args.skip)
        Path(args.row).write_text(json.dumps(row))
        return 0
    small_checkpoint()
    work = w1(num_requests=args.num_requests)
    systems = args.systems.split(",")
    record = tempfile.mktemp(suffix=".steps")
    child_argv = ["--num-requests", str(args.num_requests), "--num-kv-blocks", str(args.num_kv_blocks)]
    rows: list[dict] = []
    by_name: dict[str, dict] = {}
    for name in systems:
        print(f"running {name} ...", flush=True)
        skip = by_name.get("noria-llm", {}).get("record_skip", 0)
        rows.append(run_isolated(name, child_argv, record, skip))
        rows[-1]["tok_s"] = rows[-1]["output_tokens"] / rows[-1]["seconds"]
        by_name[rows[-1]["system"]] = rows[-1]
        print(f"  {rows[-1]['system']}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    by = {r["system"]: r for r in rows}
    print(f"\nW1: {len(work)} requests, {sum(m for _, m in work)} output tokens, {os.cpu_count()} cores")
    print(f"{'system':<14} {'seconds':>9} {'tok/s':>8}")
    for r in rows:
        print(f"{r['system']:<14} {r['seconds']:>9.1f} {r['tok_s']:>8.1f}")
    ratios = {}
    if "noria-llm" in by:
        n = by["noria-llm"]
        for base in ("hf-static-8", "hf-static-16", "hf-static-32", "hf-cb"):
            if base in by:
                ratios[f"noria-llm / {base}"] = n["tok_s"] / by[base]["tok_s"]
        if "ceiling" in by:
            ratios["noria-llm time / ceiling time"] = n["seconds"] / by["ceiling"]["seconds"]
        if "noria-serve" in by:
            ratios["noria-serve / noria-llm"] = by["noria-serve"]["tok_s"] / n["tok_s"]
        print(f"average running batch (noria): {n['avg_running_batch']:.1f}")
    for k, v in ratios.items():
        print(f"{k:<34} {v:6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=2))
    plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
