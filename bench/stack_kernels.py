"""Where a step's time goes inside the native decoder stack, kernel by kernel, on W1's batches.

    python -m noria.bench.stack_kernels [--steps FILE] [--rows 16-31] [--stride 3]

The stack (worker/native_stack.py) runs every layer in one C call, so a profiler sees a
single range; bench/profile_forward.py names the kernels by declining the stack, which puts
the Python path's glue between them. Here the stack keeps running: each kernel pointer it
calls through is swapped for a ctypes callback that times the real kernel and hands every
argument through unchanged (so the output is bit for bit the stack's). The batches are W1's
decode steps as noria ran them (recorded by a noria-llm run of W1, or `--steps` from an
earlier one), replayed as bench/ceiling.py does: scattered block tables over a written cache.
Per kernel: ms per step and its rate (GFLOP/s for the GEMMs, K/V GB/s for attention).
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from noria.worker import native_stack

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
PROTOTYPES = {  # the signatures of decoder_f32.c's kernel pointers
    "gemm": ctypes.CFUNCTYPE(None, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _INT),
    "norm": ctypes.CFUNCTYPE(None, _P, _P, _P, _P, _I64, _I64, _F, _INT),
    "rope": ctypes.CFUNCTYPE(None, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT),
    "silu": ctypes.CFUNCTYPE(None, _P, _I64, _P, _I64, _I64, _INT),
    "attn": ctypes.CFUNCTYPE(_INT, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _I64, _INT,
                             _P, _P, _P, _I64),
}


class KernelTimes:
    """Seconds, calls and work per kernel; the GEMMs apart by shape (qkv, o, gate_up, down)."""

    def __init__(self, dims: tuple[int, int, int, int, int]) -> None:
        hidden, heads, kv_heads, head_dim, inter = dims
        self.gemm_names = {((heads + 2 * kv_heads) * head_dim, hidden): "qkv", (hidden, heads * head_dim): "o",
                           (2 * inter, hidden): "gate_up", (hidden, inter): "down"}
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self.kv_bytes = 0.0

    def add(self, name: str, seconds: float, flops: float = 0.0) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1
        self.flops[name] = self.flops.get(name, 0.0) + flops


def _timed(kind: str, real: Callable[..., Any], times: KernelTimes) -> Callable[..., Any]:
    clock = time.perf_counter
    if kind == "gemm":
        def gemm(*a: Any) -> None:
            m, n, k = a[6], a[7], a[8]
            t0 = clock()
            real(*a)
            times.add(times.gemm_names.get((n, k), f"gemm {n}x{k}"), clock() - t0, 2.0 * m * n * k)
        return gemm
    if kind == "attn":
        def attn(*a: Any) -> int:
            batch, kv_heads, head_dim = a[6], a[8], a[9]
            lens = (ctypes.c_int64 * batch).from_address(a[4])
            t0 = clock()
            status = real(*a)
            times.add("attn", clock() - t0)
            times.kv_bytes += 2.0 * sum(lens) * kv_heads * head_dim * 4  # K and V rows, float32
            return status
        return attn

    def other(*a: Any) -> Any:
        t0 = clock()
        out = real(*a)
        times.add(kind, clock() - t0)
        return out
    return other


@contextmanager
def timed_kernels(times: KernelTimes) -> Iterator[None]:
    """The stack's kernels timed into `times` for the block's duration; restored afterwards."""
    loaded = native_stack.load()
    if loaded is None:
        raise RuntimeError("the native decoder stack is not available here (NORIA_DISABLE_CPU_STACK, or no compiler)")
    _, kernels = loaded
    saved = {name: getattr(kernels, name) for name, _ in kernels._fields_}
    callbacks = []  # kept alive while the stack may call them
    try:
        for name, proto in PROTOTYPES.items():
            cb = proto(_timed(name, proto(saved[name]), times))
            callbacks.append(cb)
            setattr(kernels, name, ctypes.cast(cb, _P).value)
        yield
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


def _record_w1(record: Path) -> None:
    from noria.bench.throughput import run_noria_llm
    from noria.bench.workloads import small_checkpoint, w1

    print("running W1 once (noria-llm) to record its batches ...", flush=True)
    run_noria_llm(small_checkpoint(), w1(), {"num_kv_blocks": 4096}, str(record))


@torch.inference_mode()
def profile(model_path: str, steps: list, threads: int, num_kv_blocks: int = 4096
            ) -> tuple[KernelTimes, dict[str, float]]:
    """Kernel times inside the stack, and the model's and the logits' own, summed over
    `steps` after the first (a warm-up: first calls build caches)."""
    from noria.bench.ceiling import _metadata
    from noria.frontend.startup import make_config
    from noria.worker.model_runner import ModelRunner

    runner = ModelRunner(make_config(model_path, num_kv_blocks=num_kv_blocks, num_threads=threads))
    model = runner.model
    runner.kv_cache.device_cache.uniform_(-1, 1)  # real pages (see bench/ceiling.py)
    times = KernelTimes(native_stack.model_dims(model))

    def step(query_lens: list[int], seq_lens: list[int]) -> tuple[float, float]:
        ids, meta = _metadata(runner, query_lens, seq_lens)
        last = torch.tensor(meta.query_start_host[1:]) - 1
        t0 = time.perf_counter()
        hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
        t1 = time.perf_counter()
        model.compute_logits(hidden[last]).argmax(dim=-1).tolist()  # not through the stack's pointers
        return t1 - t0, time.perf_counter() - t1

    step(steps[0][0], steps[0][1])
    totals = {"model": 0.0, "logits": 0.0}
    with timed_kernels(times):
        for query_lens, seq_lens, _, _ in steps[1:]:
            forward, logits = step(query_lens, seq_lens)
            totals["model"] += forward
            totals["logits"] += logits
    return times, totals


def report(times: KernelTimes, totals: dict[str, float], num_steps: int) -> str:
    per = 1e3 / num_steps
    lines = ["| kernel | ms per step | share of model + logits | rate |", "|---|---:|---:|---|"]
    whole = totals["model"] + totals["logits"]
    for name in sorted(times.seconds, key=lambda n: -times.seconds[n]):
        s = times.seconds[name]
        rate = ""
        if times.flops[name]:
            rate = f"{times.flops[name] / s / 1e9:.0f} GFLOP/s"
        elif name == "attn":
            rate = f"{times.kv_bytes / s / 1e9:.1f} GB/s of K/V"
        lines.append(f"| {name} | {s * per:.2f} | {s / whole:.0%} | {rate} |")
    between = totals["model"] - sum(times.seconds.values())
    # Includes the callbacks' own cost, a few microseconds per kernel call.
    lines.append(f"| the model outside the kernels | {between * per:.2f} | {between / whole:.0%} | |")
    lines.append(f"| logits (lm_head + argmax) | {totals['logits'] * per:.2f} | {totals['logits'] / whole:.0%} | |")
    lines.append(f"| **model + logits** | **{whole * per:.2f}** | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from noria.bench.ceiling import read_steps

    ap = argparse.ArgumentParser(prog="python -m noria.bench.stack_kernels")
    ap.add_argument("--steps", default=None, help="a recorded steps file (NORIA_RECORD_STEPS); default: run W1 once")
    ap.add_argument("--rows", default="16-31", help="decode steps with this many rows (lo-hi)")
    ap.add_argument("--stride", type=int, default=3, help="every this many of those steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(args.steps) if args.steps else Path(tmp) / "w1.steps"
        if not args.steps:
            _record_w1(record)
        steps = read_steps(record)
    lo, hi = (int(x) for x in args.rows.split("-"))
    chosen = [s for s in steps if sum(s[0]) == len(s[0]) and lo <= len(s[0]) <= hi][:: args.stride]
    if len(chosen) < 2:
        raise SystemExit(f"fewer than 2 decode steps with {args.rows} rows in the record")
    from noria.bench.workloads import small_checkpoint

    times, totals = profile(str(small_checkpoint()), chosen, args.threads)
    n = len(chosen) - 1
    rows = sum(len(s[0]) for s in chosen[1:]) / n
    context = sum(sum(s[1]) for s in chosen[1:]) / sum(len(s[0]) for s in chosen[1:])
    print(f"\n{n} decode steps of W1 ({args.rows} rows: {rows:.1f} on average, {context:.0f} tokens of context "
          f"each), {args.threads} threads, kernels timed inside the native stack:\n")
    print(report(times, totals, n))
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's thread and allocator settings, before torch works)

    raise SystemExit(main())
