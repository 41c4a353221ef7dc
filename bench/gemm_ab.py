"""Interleaved A/B of two builds of the native float32 GEMM (worker/csrc/gemm_f32.c), in one process.

    python -m noria.bench.gemm_ab [--base dd010a9] [--rows 1,4,8,16,...] [--threads 1] [--reps 7] [--clock cpu|wall]

"base" is the kernel source at a git revision, "new" the working tree's; both use
the same packed weights (the panel layout is theirs in common). One repetition
runs every linear layer of the "small" model (12 layers of qkv 1280x768, o
768x768, gate_up 4096x768, down 768x2048, then lm_head 32000x768: ~440 MB of
weights, so every weight comes from DRAM as in a decode step) at one row count,
base then new, alternately; medians per layer kind are reported. The outputs of
the two builds are compared bit for bit (both compute every output as the same
in-order sum). `--clock cpu` times the calling thread's CPU time, which other
jobs on a busy machine inflate far less than wall time (one thread only).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from noria.bench.workloads import SMALL
from noria.worker import gemm_kernels
from noria.worker.gemm_kernels import PackedWeight, _ptr
from noria.worker.native_build import build


def base_dll(rev: str) -> ctypes.CDLL:
    """The GEMM as it was at git revision `rev` (or in the C file at path `rev`), built like the worker's."""
    if Path(rev).is_file():
        src = Path(rev).read_bytes()
    else:
        src = subprocess.run(["git", "show", f"{rev}:worker/csrc/gemm_f32.c"], check=True, capture_output=True,
                             cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "gemm_f32.c"
    path.write_bytes(src)
    dll = build(path, gemm_kernels._FLAGS)
    assert dll is not None, "no C compiler"
    dll.gemm_f32.argtypes = gemm_kernels.load().gemm_f32.argtypes  # type: ignore[union-attr]
    return dll


def _shapes() -> dict[str, tuple[int, int]]:
    h, i, heads, kv = (SMALL[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads"))
    hd = h // heads
    return {"qkv": (h + 2 * kv * hd, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (SMALL["vocab_size"], h)}


def _run(dll: ctypes.CDLL, xs: dict[str, torch.Tensor], ws: list[tuple[str, PackedWeight]],
         ys: dict[str, torch.Tensor], threads: int, clock) -> dict[str, float]:
    spent = dict.fromkeys(xs, 0.0)
    for kind, w in ws:
        x, y = xs[kind], ys[kind]
        t0 = clock()
        dll.gemm_f32(_ptr(x), x.stride(0), w.ptr, None, _ptr(y), y.stride(0), x.shape[0], w.out_features,
                     w.in_features, threads)
        spent[kind] += clock() - t0
    return spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.gemm_ab")
    ap.add_argument("--base", default="dd010a9", help="git revision (or C file) of the base kernel (default: before prefetching)")
    ap.add_argument("--rows", default="1,4,8,16,18,24,31,32,48,63,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use --threads 1 or --clock wall")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    new = gemm_kernels.load()
    assert new is not None, "no C compiler"
    dlls = {"base": base_dll(args.base), "new": new}
    shapes = _shapes()
    torch.manual_seed(0)
    layers = [(kind, PackedWeight(torch.randn(n, k) * k**-0.5)) for _ in range(SMALL["num_hidden_layers"])
              for kind, (n, k) in shapes.items() if kind != "lm_head"]
    layers.append(("lm_head", PackedWeight(torch.randn(*shapes["lm_head"]) * shapes["lm_head"][1] ** -0.5)))
    per_kind = {kind: sum(1 for k, _ in layers if k == kind) for kind in shapes}
    print(f"base {args.base}, threads {args.threads}, clock {args.clock}, {args.reps} reps; ms per call (median),"
          " GFLOP/s and weight GB/s of new")
    print("| rows | " + " | ".join(f"{k} base → new" for k in shapes) + " | layers GFLOP/s | all GB/s | base / new |")
    print("|---:|" + "---:|" * (len(shapes) + 3))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {kind: torch.randn(rows, k) for kind, (n, k) in shapes.items()}
        outs = {v: {kind: torch.empty(rows, n) for kind, (n, k) in shapes.items()} for v in dlls}
        times: dict[str, dict[str, list[float]]] = {v: {kind: [] for kind in shapes} for v in dlls}
        for rep in range(args.reps + 1):
            for v, dll in dlls.items():
                spent = _run(dll, xs, layers, outs[v], args.threads, clock)
                if rep:  # the first is a warm-up
                    for kind, s in spent.items():
                        times[v][kind].append(s / per_kind[kind])
        assert all(torch.equal(outs["base"][k], outs["new"][k]) for k in shapes), "base and new differ"
        med = {v: {k: sorted(t)[len(t) // 2] for k, t in kt.items()} for v, kt in times.items()}
        total = {v: sum(med[v][k] * per_kind[k] for k in shapes) for v in dlls}
        layer_s = sum(med["new"][k] * per_kind[k] for k in shapes if k != "lm_head")
        layer_flop = sum(2 * rows * n * k * per_kind[kind] for kind, (n, k) in shapes.items() if kind != "lm_head")
        weight_bytes = sum(4 * n * k * per_kind[kind] for kind, (n, k) in shapes.items())
        print(f"| {rows} | " + " | ".join(f"{med['base'][k] * 1e3:.3f} → {med['new'][k] * 1e3:.3f}" for k in shapes)
              + f" | {layer_flop / layer_s / 1e9:.0f} | {weight_bytes / total['new'] / 1e9:.1f}"
              f" | {total['base'] / total['new']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's thread and allocator settings, before torch works)

    raise SystemExit(main())
