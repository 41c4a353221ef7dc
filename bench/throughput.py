"""`noria bench throughput`: offline W1 on the "small" model, every system in one run.

Systems (pick with --systems): hf-static-8/16/32 (HF `generate`, static
left-padded batches, each runs until its longest request; only requested
tokens count), hf-cb (HF continuous batching manager at its best CPU
settings), noria-llm (`LLM.generate`), noria-serve (`noria serve` + the
client library, all requests at once; noria-serve-N at most N in flight,
as the llama.cpp systems run with --in-flight N, 16 by default), noria-llm-tp2 (`LLM.generate` with
tensor parallelism over two ranks), ceiling (noria's recorded batch shapes
replayed as bare forward passes), vllm and vllm-tuned (vLLM's CPU backend
in its own venv, its defaults and with every core; see bench/vllm_cpu.py;
skipped with a message where it cannot be installed), llama.cpp-f32 and
llama.cpp-bf16 (llama.cpp's own server on the same weights as F32 and BF16
GGUF, W1 with --in-flight requests (16) in flight through its /completion, as many slots; built from the
llama-cpp-python sdist's source, see bench/llama_cpp.py; skipped with a
message where it cannot be built), and llama.cpp (the same server on a GGUF
model's own file: `--model small-q4_k_m --systems noria-llm,noria-serve-16,llama.cpp`
runs noria and llama.cpp on the very same file; HF and vLLM take a folder and
are refused for a GGUF model, llama.cpp-f32/-bf16 likewise, llama.cpp for a folder). The noria, vLLM and llama.cpp rows run
--rounds times, interleaved, and the best of each is reported next to every
run's time; vLLM's and llama.cpp's greedy tokens are compared with noria-llm's.
Prints a table of output tokens/s and ratios, writes JSON and a PNG bar chart.
With any noria system, the machine's copy_ bandwidth and float32 GEMM peak are
measured at the start of each round and again after every recorded run, and every
recorded run gets its roofline: each step's floor, summed, against the run's wall
and forward time, a table by row count and a scatter of step time against roofline
(OUT-roofline.png; bench/roofline.py). The floor is against the job's best probe;
beside it, against the best of the two probes that bracket the run (on a host whose
speed drifts, the job's best can come from a fast spell the run never saw).
Each system runs in a process of its own (run_isolated); the runners of HF, noria and
the ceiling are bench/throughput_runners.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from noria.bench import llama_cpp, vllm_cpu
from noria.bench.plots import pyplot
from noria.bench.throughput_runners import (
    Work,
    run_ceiling,
    run_hf_cb,
    run_hf_static,
    run_noria_llm,
    run_noria_serve,
)
from noria.bench.workloads import CHECKPOINTS, w1


def plot(rows: list[dict], runs: dict[str, list[dict]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["system"] for r in rows]
    vals = [r["tok_s"] for r in rows]
    # Whiskers: the slowest of the repeated runs (the bar is the best).
    lows = [v - min(x["tok_s"] for x in runs.get(n, [r])) for n, v, r in zip(names, vals, rows, strict=True)]
    ax.barh(names, vals, xerr=[lows, [0] * len(vals)], capsize=3,
            color=["#4c72b0" if n.startswith("noria") else "#dd8452" if n == "ceiling"
                   else "#55a868" if n.startswith("vllm") else "#999999" for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center")
    ax.set_xlabel("output tokens / s (W1, small model, CPU; best of the repeated runs)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def workload(args: argparse.Namespace) -> Work:
    work = w1(num_requests=args.num_requests)
    if args.max_tokens:
        work = [(p, min(m, args.max_tokens)) for p, m in work]
    return work


def run_one(name: str, args: argparse.Namespace, record: str, skip: int) -> dict:
    path = CHECKPOINTS[args.model]()
    work = workload(args)
    flags = {"num_kv_blocks": args.num_kv_blocks, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    if name.startswith("hf-static-"):
        return run_hf_static(path, work, int(name.rsplit("-", 1)[1]))
    if name == "hf-cb":
        return run_hf_cb(path, work)
    if name == "noria-llm":
        return run_noria_llm(path, work, flags, record)
    if name == "noria-llm-tp2":
        # Two ranks over gloo on the same cores: each rank runs half the heads and columns
        # with half the threads, plus two all-reduces per layer.
        return {**run_noria_llm(path, work, {**flags, "tensor_parallel_size": 2}, record), "system": name}
    if name == "noria-serve" or serve_limit(name):
        return run_noria_serve(path, work, ["--num-kv-blocks", str(args.num_kv_blocks), "--dtype", args.dtype,
                                            "--kv-cache-dtype", args.kv_cache_dtype],
                               record, serve_limit(name))
    if name == "ceiling":
        return run_ceiling(path, record, flags, skip)
    raise SystemExit(f"unknown system {name!r}")


def run_isolated(name: str, argv: list[str], record: str, skip: int, args: argparse.Namespace) -> dict:
    """Each system in its own process: its own threads, memory and OpenMP settings.
    HF runs in torch's default settings; the ceiling in the worker's (see `main`);
    vLLM in its own venv's python with its own settings (vllm_cpu.child_env)."""
    if name in vllm_cpu.SYSTEMS:
        return vllm_cpu.run_offline(name, CHECKPOINTS[args.model](), workload(args), dtype=args.dtype)
    if name in llama_cpp.SYSTEMS:  # the server is its own process; this one is only its client
        return llama_cpp.run_throughput(name, CHECKPOINTS[args.model](), workload(args), args.in_flight)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "noria.bench.throughput", *argv, "--one", name, "--record", record,
                        "--skip", str(skip), "--row", out.name], check=True)
        return json.loads(Path(out.name).read_text())


SERVE_16 = f"noria-serve-{llama_cpp.IN_FLIGHT}"  # at most as many requests in flight as llama.cpp's runs
REPEATED = ("noria-llm", "vllm", "vllm-tuned", *llama_cpp.SYSTEMS, "noria-serve", SERVE_16, "ceiling")
RECORDED = ("noria-llm", "noria-serve", "noria-llm-tp2")  # their workers record each step (and noria-serve-N's)


def serve_limit(name: str) -> int | None:
    """N of a `noria-serve-N` system (`noria serve` with at most N requests in flight), else None."""
    m = re.fullmatch(r"noria-serve-([1-9][0-9]*)", name)
    return int(m.group(1)) if m else None


def repeated(systems: list[str]) -> list[str]:
    """The systems each round runs, in REPEATED's order, a noria-serve-N in noria-serve-16's place."""
    return [s for r in REPEATED for s in systems if s == r or (r == SERVE_16 and serve_limit(s) and s != r)]


def recorded(name: str) -> bool:
    return name in RECORDED or serve_limit(name) is not None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="noria bench throughput")
    ap.add_argument("--systems", default="hf-static-8,hf-static-16,hf-static-32,hf-cb,noria-llm,noria-serve,ceiling")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3,
                    help="run noria-llm, noria-serve and the ceiling this many times, interleaved; "
                         "report the best of each (a shared machine's slow spells then hit no system alone)")
    ap.add_argument("--out", default="bench/results/throughput")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--model", choices=sorted(CHECKPOINTS), default="small",
                    help="the benchmark model (\"serving\" is smaller, for quick runs)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every request's output length")
    ap.add_argument("--dtype", default="auto",
                    help="noria's and vLLM's --dtype (auto: each one's default for the checkpoint)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="noria's --kv-cache-dtype (fp8: one byte per cached value, a scale per layer)")
    ap.add_argument("--in-flight", type=int, default=llama_cpp.IN_FLIGHT,
                    help="the llama.cpp systems' requests in flight (and llama-server's slots); compare with "
                         "noria-serve-N of the same N")
    ap.add_argument("--no-vllm-install", action="store_true",
                    help="skip the vLLM systems unless vLLM's venv is already made (else it is made on first use)")
    ap.add_argument("--no-llama-cpp-install", action="store_true",
                    help="skip the llama.cpp systems unless llama-server is already built (else it is built on first use)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run one system
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        if args.one == "ceiling":
            # The replay runs the model in this process: the worker's process settings
            # (OpenMP waits, huge pages), before torch loads, as a worker process has them.
            from noria.worker.cli import set_process_env

            set_process_env()
        row = run_one(args.one, args, args.record, args.skip)
        Path(args.row).write_text(json.dumps(row))
        return 0
    _refuse_gguf(args.systems.split(","), CHECKPOINTS[args.model](), args.model)
    _refuse_unlike_limits(args.systems.split(","), args.in_flight)
    work = workload(args)
    systems = _available(args.systems.split(","), install=not args.no_vllm_install)
    systems = llama_cpp.available(systems, CHECKPOINTS[args.model](), install=not args.no_llama_cpp_install)
    if "ceiling" in systems and "noria-llm" not in systems:
        raise SystemExit("the ceiling replays noria-llm's batches: include noria-llm")
    runs, machines = _run_rounds(args, systems)
    rows = [min(runs[name], key=lambda x: x["seconds"]) for name in systems]
    print(f"\nW1 ({args.model} model): {len(work)} requests, {sum(m for _, m in work)} output tokens, {os.cpu_count()} cores")
    ratios = _report(rows, runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    limit = _roofline(args, runs, machines, out) if machines else None
    for group in runs.values():
        for x in group:
            for key in ("record", "token_ids", "_steps", "_probes"):
                x.pop(key, None)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "runs": runs, "ratios": ratios,
                                                    "roofline": limit}, indent=2))
    plot(rows, runs, out.with_suffix(".png"))
    return 0


def _refuse_unlike_limits(systems: list[str], in_flight: int) -> None:
    """noria-serve-N beside llama.cpp is a like-for-like comparison only at llama.cpp's own limit."""
    unlike = [s for s in systems if serve_limit(s) not in (None, in_flight)]
    if unlike and any(s in llama_cpp.SYSTEMS for s in systems):
        raise SystemExit(f"{', '.join(unlike)} beside llama.cpp at --in-flight {in_flight}: give the same number")


def _refuse_gguf(systems: list[str], path: Path, model: str) -> None:
    """A GGUF model runs on noria's and llama.cpp's systems alone: HF's and vLLM's runners load a
    checkpoint folder (llama_cpp.available refuses llama.cpp's converting systems)."""
    if not llama_cpp.is_gguf(path):
        return
    folder_only = [s for s in systems if s.startswith("hf-") or s in vllm_cpu.SYSTEMS]
    if folder_only:
        raise SystemExit(f"--model {model} is a GGUF file ({path.name}), which {', '.join(folder_only)} cannot load: "
                         f"run noria's systems and llama.cpp on it")


def _noria_dtype(dtype: str, path: Path) -> str:
    """What noria's `--dtype` resolves to for this checkpoint (or GGUF file, read through its
    folder view as noria reads it) on this host's CPU."""
    import torch

    from noria.frontend.demo_model import resolve_model
    from noria.protocol.model_spec import read_spec
    from noria.worker.device import choose_dtype

    return choose_dtype(dtype, torch.device("cpu"), read_spec(resolve_model(str(path))).dtype).name


def _roofline(args: argparse.Namespace, runs: dict[str, list[dict]], machines: list, out: Path) -> dict:
    """Print every recorded run's roofline (bench/roofline.py), plot its steps; the JSON part."""
    from noria.bench import roofline
    from noria.bench.roofline_machine import Machine

    machine = Machine.best(machines)
    path = CHECKPOINTS[args.model]()
    # The bytes per weight and KV value of the dtype the runs compute in (noria's --dtype, resolved).
    dtype = _noria_dtype(args.dtype, path)
    shape = dataclasses.replace(roofline.Shape.from_checkpoint(path), dtype_bytes=roofline.DTYPE_BYTES[dtype],
                                dtype=dtype)
    analyses = roofline.from_runs(shape, machine, runs)
    print(roofline.report(machine, analyses))
    bracketed = roofline.bracketed(shape, machines, runs)
    print(roofline.format_bracketed(bracketed))
    best = roofline.best_per_system(analyses)
    png = out.with_name(out.name + "-roofline.png")
    roofline.plot(best, png, f"copy_ {machine.copy_gbs:.1f} GB/s, GEMM {machine.gflops(shape.dtype):.0f} GFLOP/s")
    print(f"plot of each step against its roofline: {png}")
    for name, a in analyses.items():
        if name not in best:
            a.pop("per_step")
    return {"machine": machine.to_json(), "machines": [m.to_json() for m in machines], "runs": analyses,
            "bracketed": bracketed}


def _available(systems: list[str], install: bool) -> list[str]:
    """The systems that can run here: the vLLM ones only where its venv is (or can be) made."""
    wanted = [s for s in systems if s in vllm_cpu.SYSTEMS]
    why = vllm_cpu.setup(install=install) if wanted else None
    if why:
        print(f"skipping {', '.join(wanted)}: {why}", flush=True)
        return [s for s in systems if s not in vllm_cpu.SYSTEMS]
    return systems


def _run_rounds(args: argparse.Namespace, systems: list[str]) -> tuple[dict[str, list[dict]], list]:
    """Every system once, then the repeated ones interleaved for `--rounds` rounds; with any noria
    system, the machine's bandwidth and GEMM peak are measured at each round's start and after every
    recorded run (for the roofline): a recorded run's row names its bracketing probes ("_probes")."""
    from noria.bench.ceiling import read_steps
    from noria.bench.process_rss import format_rss
    from noria.bench.roofline_machine import measure_in_child

    child_argv = ["--num-requests", str(args.num_requests), "--num-kv-blocks", str(args.num_kv_blocks),
                  "--model", args.model, "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype,
                  *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])]
    runs: dict[str, list[dict]] = {}
    machines: list = []
    with tempfile.TemporaryDirectory() as tmp:

        def measure() -> None:
            if any(recorded(s) for s in systems):
                print("measuring the machine (copy_ bandwidth, float32 GEMM) ...", flush=True)
                machines.append(measure_in_child(os.cpu_count() or 1))  # the worker's thread count; it prints

        def run(name: str, tag: str, replay_of: dict | None = None) -> bool:
            """Runs `name`; True when a probe followed it (a recorded run)."""
            print(f"running {name}{tag} ...", flush=True)
            fresh = Path(tmp) / f"{name}-{sum(map(len, runs.values()))}.steps"
            record = replay_of["record"] if replay_of else str(fresh)
            skip = replay_of["record_skip"] if replay_of else 0
            before = len(machines) - 1
            row = run_isolated(name, child_argv, record, skip, args)
            row["tok_s"] = row["output_tokens"] / row["seconds"]
            if "record" in row or replay_of:  # the steps, for the roofline (the record is a temporary file)
                row["_steps"] = replay_of["_steps"] if replay_of else read_steps(row["record"], row["record_skip"])
            runs.setdefault(row["system"], []).append(row)
            extra = f", model {row['model_seconds']:.1f} s of {row['seconds']:.1f} s" if "model_seconds" in row else ""
            extra += f" (start-up, not timed: {row['startup_seconds']:.0f} s)" if "startup_seconds" in row else ""
            print(f"  {row['system']}: {row['tok_s']:.1f} tok/s{extra}", flush=True)
            for when, rss in row.get("rss_bytes", {}).items():
                print(f"    RSS {when}: {format_rss(rss)}", flush=True)
            if "_steps" not in row:
                return False
            measure()
            row["_probes"] = [before, len(machines) - 1]
            return True

        probed = False  # whether a probe followed the latest run
        for name in systems:
            if name not in repeated(systems):
                probed = run(name, "")
        for r in range(args.rounds):
            tag = f" (round {r + 1}/{args.rounds})"
            measure()
            for name in repeated(systems):
                probed = run(name, tag, runs["noria-llm"][-1] if name == "ceiling" else None)
        # After the last run too (if it was not a recorded one, just probed): the peak is the best of
        # the probes (Machine.best), and on a host whose speed drifts a single probe at the start
        # under-reads it as often as not (2026-11-23: a probe of 106 GFLOP/s, then prefill steps of
        # the same job at 122).
        if not probed:
            measure()
    return runs, machines


def _report(rows: list[dict], runs: dict[str, list[dict]]) -> dict[str, float]:
    """Print the table and the ratios against the baselines run in the same job."""
    by = {r["system"]: r for r in rows}
    print(f"{'system':<14} {'seconds':>9} {'tok/s':>8}  runs (s)")
    for r in rows:
        each = " ".join(f"{x['seconds']:.1f}" for x in runs[r["system"]])
        print(f"{r['system']:<14} {r['seconds']:>9.1f} {r['tok_s']:>8.1f}  {each}")
    ratios: dict[str, float] = {}
    if "noria-llm" in by:
        n = by["noria-llm"]
        for base in ("hf-static-8", "hf-static-16", "hf-static-32", "hf-cb"):
            if base in by:
                ratios[f"noria-llm / {base}"] = n["tok_s"] / by[base]["tok_s"]
        if "ceiling" in by:
            ratios["noria-llm time / ceiling time"] = n["seconds"] / by["ceiling"]["seconds"]
            # Each round's pair ran back to back: a ratio less exposed to slow spells.
            pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs["noria-llm"], runs["ceiling"], strict=False)]
            ratios["noria-llm time / ceiling time, median of rounds"] = sorted(pairs)[len(pairs) // 2]
        for name in ("noria-llm", "noria-serve"):
            if name in by:
                ratios[f"{name} wall / its own forward time"] = by[name]["seconds"] / by[name]["model_seconds"]
        if "noria-serve" in by:
            ratios["noria-serve / noria-llm"] = by["noria-serve"]["tok_s"] / n["tok_s"]
        if "noria-llm-tp2" in by:
            ratios["noria-llm-tp2 / noria-llm"] = by["noria-llm-tp2"]["tok_s"] / n["tok_s"]
    for limited in (s for s in by if serve_limit(s)):  # like for like with llama.cpp: the same client limit
        for v in llama_cpp.SYSTEMS:
            if v in by:
                ratios[f"{limited} / {v}"] = by[limited]["tok_s"] / by[v]["tok_s"]
    if "noria-llm" in by:
        n = by["noria-llm"]
        for v in (*vllm_cpu.SYSTEMS, *llama_cpp.SYSTEMS):
            if v in by:
                ratios.update(vllm_cpu.compare(runs["noria-llm"], runs[v]))
        ratios.update(vllm_cpu.versus_best([by[v] for v in vllm_cpu.SYSTEMS if v in by], n))
        print(f"average running batch (noria): {n['avg_running_batch']:.1f}")
    _report_rss(rows)
    width = max(map(len, ratios), default=0)
    for k, v in ratios.items():
        print(f"{k:<{width}} {v:6.2f}")
    return ratios


def _report_rss(rows: list[dict]) -> None:
    """Each server process's RSS, for the rows that ran a server (noria-serve's best run, and any
    other row with "rss_bytes" from bench/process_rss.py): idle after start-up, and at the end."""
    from noria.bench.process_rss import format_rss

    for r in rows:
        for when, rss in r.get("rss_bytes", {}).items():
            print(f"{r['system']} RSS, {when}: {format_rss(rss)}")


if __name__ == "__main__":
    raise SystemExit(main())
