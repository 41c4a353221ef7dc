"""The CPU GEMMs over quantized weights against the float32 and bf16 ones, on the "small" model's shapes.

`python -m noria.bench.gemm_quant`: per linear layer of the "small" model (hidden 768, intermediate
2048: qkv N = 1536, o 768, gate_up 4096 at K = 768; down N = 768 at K = 2048; the lm head stays float)
and row count (1 / 8 / 32 / 128 / 512), the median milliseconds per call of the float32 GEMM
(worker/gemm_kernels.py), the bf16 one in this CPU's layout (worker/gemm_bf16_kernels.py: "dot" with
AVX512_BF16) and the quantized ones (worker/gemm_quant_kernels.py): W8A8 (int8 weights and dynamic
int8 activations), W4A8 (int4 weights, group 128, int8 activations with a scale per row and group of
128; symmetric, with zero points, and with GGUF Q4_K-style float minimums), W8A8g (8-bit weights on W4A8's
activations: group 32 symmetric as GGUF Q8_0, group 16 as Q6_K, group 16 with minimums as Q4_K_M's fused
Q4_K / Q6_K layers), W4A16 and W8A16 (weight-only, group 128, symmetric) and W4A16 with zero points;
each one's speed-up over float32, then GFLOP/s and weight GB/s (the packed weight's bytes per call).
Few rows are bound by the weight bytes (int8 reads a quarter of float32's, int4 an eighth), many by
arithmetic (W8A8's vpdpbusd multiplies four times as many pairs per instruction as a float32 FMA).
By default the weights are the same every call, so they are read from the caches (L3 holds all of
these); `--kernels` picks some of them (f32 always runs: the ratios are against it); `--cold` cycles each kernel through copies of its weight totalling more than 64 MiB, so every
call reads its weight from memory, as a model's layers in turn do. On a loaded machine, --threads 1.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
from collections.abc import Callable

import torch

from noria.bench.gemm_bf16 import median_seconds
from noria.worker import gemm_bf16_kernels, gemm_kernels, gemm_quant_groups, gemm_quant_kernels
from noria.worker.gemm_quant_groups import PackedInt4Weight, PackedInt8GroupWeight
from noria.worker.gemm_quant_kernels import PackedGroupWeight, PackedInt8Weight

SHAPES = {"qkv": (1536, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}  # (N, K)
ROWS = [1, 8, 32, 128, 512]
GROUP = 128
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni")


def cpu_facts() -> str:
    """The CPU's model name, the threads, its flags of interest and the int8 path built."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    have = [f for f in FLAGS_OF_INTEREST if f in flags]
    lacks = [f for f in FLAGS_OF_INTEREST if f not in flags]
    return (f"{fields.get('Model name', 'unknown CPU').strip()}, {torch.get_num_threads()} threads; "
            f"has: {' '.join(have) or '-'}; lacks: {' '.join(lacks) or '-'}; int8 path: {gemm_quant_kernels.isa()}")


COLD_BYTES = 64 << 20


def _f32(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
    w = gemm_kernels.PackedWeight(torch.randn(n, k) / k**0.5)
    return (lambda x: gemm_kernels.gemm(x, w, None)), w.data.numel() * 4


def _bf16(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
    w = gemm_bf16_kernels.PackedHalfWeight(torch.randn(n, k) / k**0.5)
    return (lambda x: gemm_bf16_kernels.gemm_bf16(x, w, None)), w.data.numel() * 2


def _w8a8(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
    w = PackedInt8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 127)
    return (lambda x: gemm_quant_kernels.gemm_w8a8(x, w, None)), w.nbytes


def _weight_only(bits: int, zero: bool) -> Callable[[int, int], tuple[Callable[[torch.Tensor], object], int]]:
    def make(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
        lo, hi, groups = -(2 ** (bits - 1)), 2 ** (bits - 1), k // GROUP
        z = torch.randint(lo, hi, (n, groups), dtype=torch.int8) if zero else None
        w = PackedGroupWeight(torch.randint(lo, hi, (n, k), dtype=torch.int8), torch.rand(n, groups) / 8, z, GROUP,
                              bits)
        return (lambda x: gemm_quant_kernels.gemm_wq(x, w, None)), w.nbytes

    return make


def _w4a8(mode: str) -> Callable[[int, int], tuple[Callable[[torch.Tensor], object], int]]:
    """mode: "sym", "zero" (zero points) or "min" (unsigned q with float minimums)."""
    def make(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
        groups = k // GROUP
        z = torch.randint(-8, 8, (n, groups), dtype=torch.int8) if mode == "zero" else None
        mi = torch.rand(n, groups) / 4 if mode == "min" else None
        lo = 0 if mode == "min" else -8
        w = PackedInt4Weight(torch.randint(lo, lo + 16, (n, k), dtype=torch.int8), torch.rand(n, groups) / 8, z,
                             GROUP, mi)
        return (lambda x: gemm_quant_groups.gemm_w4a8(x, w, None)), w.nbytes

    return make


def _w8a8g(group: int, mode: str) -> Callable[[int, int], tuple[Callable[[torch.Tensor], object], int]]:
    """8-bit weights, groups of `group`; mode "sym" or "min" (float minimums)."""
    def make(n: int, k: int) -> tuple[Callable[[torch.Tensor], object], int]:
        groups = k // group
        mi = torch.rand(n, groups) / 4 if mode == "min" else None
        w = PackedInt8GroupWeight(torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, groups) / 8,
                                  None, group, mi)
        return (lambda x: gemm_quant_groups.gemm_w8a8g(x, w, None)), w.nbytes

    return make


def makers() -> dict[str, Callable[[int, int], tuple[Callable[[torch.Tensor], object], int]]]:
    return {"f32": _f32, f"bf16-{gemm_bf16_kernels.layout()}": _bf16, "w8a8": _w8a8,
            "w4a8": _w4a8("sym"), "w4a8z": _w4a8("zero"), "w4a8m": _w4a8("min"),
            "w8a8g": _w8a8g(32, "sym"), "w8a8g16": _w8a8g(16, "sym"), "w8a8g16m": _w8a8g(16, "min"),
            "w4a16": _weight_only(4, False), "w4a16z": _weight_only(4, True), "w8a16": _weight_only(8, False)}


def kernels(n: int, k: int, cold: bool,
            names: list[str] | None = None) -> dict[str, tuple[Callable[[torch.Tensor], object], int]]:
    """Per kernel name (all, or f32 and `names`): (call taking x, weight bytes); `cold`: each call on the next
    of enough copies of the weight to overflow the caches."""
    out = {}
    for name, make in makers().items():
        if names is not None and name != "f32" and name not in names:
            continue
        first = make(n, k)
        built = [first] + ([make(n, k) for _ in range(-(-COLD_BYTES // first[1]) - 1)] if cold else [])
        calls = itertools.cycle([call for call, _ in built])
        out[name] = ((lambda x, calls=calls: next(calls)(x)), first[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: torch's count)")
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--layers", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--cold", action="store_true", help="weights read from memory: copies over 64 MiB in turn")
    parser.add_argument("--kernels", nargs="*", default=None, help="only these (and f32): "
                        "f32 bf16-<layout> w8a8 w4a8 w4a8z w4a8m w8a8g w8a8g16 w8a8g16m w4a16 w4a16z w8a16")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kernels or []) - set(makers()))
    if unknown:
        parser.error(f"unknown kernels {', '.join(unknown)}: of {', '.join(makers())}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if gemm_kernels.load() is None or gemm_bf16_kernels.load() is None or gemm_quant_kernels.load() is None:
        print("the native GEMMs are not built (no C compiler, or the gemm family is on torch)")
        return 1
    print(cpu_facts() + ("; weights from memory (--cold)" if args.cold else "; weights from the caches"))
    torch.manual_seed(0)
    rates: list[str] = []
    for layer in args.layers:
        n, k = SHAPES[layer]
        calls = kernels(n, k, args.cold, args.kernels)
        if layer == args.layers[0]:
            print(f"{'layer':<8} {'N':>5} {'K':>5} {'rows':>4}" + "".join(f" {name + ' ms':>10} {'f32/':>5}"
                                                                       for name in calls))
            rates.append(f"{'layer':<8} {'rows':>4}" + "".join(f" {name:>14}" for name in calls)
                         + "   (GFLOP/s / weight GB/s)")
        for rows in args.rows:
            x = torch.randn(rows, k)
            times = {name: median_seconds(lambda call=call, x=x: call(x), args.repeats)
                     for name, (call, _) in calls.items()}
            t32 = times["f32"]
            print(f"{layer:<8} {n:>5} {k:>5} {rows:>4}" + "".join(f" {t * 1e3:>10.4f} {t32 / t:>5.2f}"
                                                                   for t in times.values()))
            flop = 2 * rows * n * k
            rates.append(f"{layer:<8} {rows:>4}" + "".join(
                f" {flop / t / 1e9:>7.0f}/{calls[name][1] / t / 1e9:<6.0f}" for name, t in times.items()))
    print()
    print("\n".join(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
