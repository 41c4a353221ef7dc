"""What this CPU can do, measured in the benchmark's own job: streaming bandwidth and float32 GEMM peak.

    python -m noria.bench.roofline_machine [--threads N] [--out FILE]
    python -m noria.bench.roofline_machine --sustain 60 [--window 5]

Runs in a process of its own with the worker's settings (its OpenMP wait
policy and huge pages, set when noria.worker is imported before torch; the
worker's thread count), so that it measures what the worker could reach:

* copy bandwidth: `dst.copy_(src)` of a float32 tensor far larger than the
  last-level cache, counted as STREAM counts Copy: bytes read plus bytes
  written (2 x size). The caches' write-allocate reads of `dst` are not
  counted, as in STREAM: this is the rate a program moves its own bytes.
* read bandwidth: `src.sum()` of the same tensor (read only, the weights'
  access pattern), for reference.
* GEMM peak: the faster of a large square float32 `torch.mm` (2 n^3 FLOPs)
  and an `F.linear` of n rows through a weight the shape of an MLP's
  (2n x n/2), as the worker's prefill chunks run them; and the native bf16
  GEMM (worker/csrc/gemm_bf16.c, this host's layout: vdpbf16ps where the CPU
  has AVX512_BF16) on that F.linear shape, the peak a bf16 run computes at.
Each is the best of several repetitions (a shared machine's slow spells
only ever lower a measurement). The theoretical FMA peak comes from
/proc/cpuinfo: threads x clock x FLOPs per cycle of the widest FMA.

`--sustain S` instead runs the square GEMM back to back for S seconds and
prints its rate per window: on a host that throttles sustained load (or
lends its cores out in spells) the windows fall well below the best of the
short repetitions, and a minute-long run sees the windows, not the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    threads: int
    copy_gbs: float  # STREAM Copy: (read + written) bytes / s, 1e9
    read_gbs: float  # a reduction's bytes read / s, 1e9
    gemm_gflops: float  # float32 torch.mm, 1e9 FLOP / s
    gemm_n: int
    stream_mib: int
    fma_peak_gflops: float | None  # threads x GHz x FLOPs/cycle, None when unknown
    fma_peak_how: str
    bf16_gflops: float | None = None  # the native bf16-weight GEMM, None where it does not build
    bf16_layout: str = ""
    int8_gops: float | None = None  # the native W8A8 GEMM (int8 dot products), None where it does not build

    @staticmethod
    def best(ms: list[Machine]) -> Machine:
        """The best of several measurements in one job, per quantity (the machine's peak)."""
        first = ms[0]
        return Machine(threads=first.threads, copy_gbs=max(m.copy_gbs for m in ms),
                       read_gbs=max(m.read_gbs for m in ms), gemm_gflops=max(m.gemm_gflops for m in ms),
                       gemm_n=first.gemm_n, stream_mib=first.stream_mib, fma_peak_gflops=first.fma_peak_gflops,
                       fma_peak_how=first.fma_peak_how,
                       bf16_gflops=max((m.bf16_gflops for m in ms if m.bf16_gflops), default=None),
                       bf16_layout=first.bf16_layout,
                       int8_gops=max((m.int8_gops for m in ms if m.int8_gops), default=None))

    def gflops(self, dtype: str) -> float:
        """The GEMM peak a run whose weights are `dtype` computes at: the bf16 GEMM's for bfloat16,
        the int8 GEMM's for "int8" (W8A8), else float32's (float16 weights are widened to float32
        FMAs on a CPU)."""
        if dtype == "int8" and self.int8_gops:
            return self.int8_gops
        return self.bf16_gflops if dtype == "bfloat16" and self.bf16_gflops else self.gemm_gflops

    def to_json(self) -> dict:
        return asdict(self)


def flops_per_cycle(flags: set[str], vendor: str) -> tuple[int, str]:
    """float32 FLOPs per cycle per core of the widest FMA, assuming two FMA pipes of the vector width
    (Intel since Haswell; AMD Zen 2-4 at 256 bits; Zen 1 has half of that, not told apart here)."""
    if "avx512f" in flags and vendor != "AuthenticAMD":
        return 64, "AVX-512: 2 FMA x 16 lanes x 2"
    if "avx512f" in flags:  # Zen 4 runs 512-bit FMAs as two 256-bit halves
        return 32, "AVX-512 on AMD (2 x 256-bit halves): 2 FMA x 8 lanes x 2"
    if "fma" in flags and "avx2" in flags:
        return 32, "AVX2+FMA: 2 FMA x 8 lanes x 2"
    if "avx" in flags:
        return 16, "AVX, no FMA: 8-lane add + 8-lane mul"
    return 8, "SSE: 4-lane add + 4-lane mul"


def theoretical_peak(cpuinfo: str, threads: int) -> tuple[float | None, str]:
    """threads x clock (GHz, /proc/cpuinfo's "cpu MHz" of the first core) x FLOPs/cycle."""
    mhz, flags, vendor = None, set(), ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "cpu MHz" and mhz is None:
            mhz = float(value)
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    if mhz is None or not flags:
        return None, "no clock or flags in /proc/cpuinfo"
    per_cycle, how = flops_per_cycle(flags, vendor)
    ghz = mhz / 1000
    return threads * ghz * per_cycle, f"{threads} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle ({how})"


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch, page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _stream(n: int, repeats: int) -> tuple[float, float]:
    """Best seconds of a copy_ and of a sum of `n` float32 (the tensors are freed on return)."""
    import torch

    src = torch.empty(n, dtype=torch.float32).uniform_(-1, 1)
    dst = torch.empty_like(src).zero_()  # touched: no page faults inside the timed copies
    return _best_seconds(lambda: dst.copy_(src), repeats), _best_seconds(lambda: src.sum(), repeats)


def measure(threads: int, stream_mib: int = 256, gemm_n: int = 2048, repeats: int = 8) -> Machine:
    import torch

    torch.set_num_threads(threads)
    n = stream_mib * (1 << 20) // 4
    copy_s, read_s = _stream(n, repeats)
    a = torch.randn(gemm_n, gemm_n)
    b = torch.randn(gemm_n, gemm_n)
    c = torch.empty(gemm_n, gemm_n)
    x = torch.randn(gemm_n, gemm_n // 2)
    w = torch.randn(2 * gemm_n, gemm_n // 2)
    # Both shapes do 2 n^3 FLOPs.
    gemm_s = min(_best_seconds(lambda: torch.mm(a, b, out=c), max(3, repeats // 2)),
                 _best_seconds(lambda: torch.nn.functional.linear(x, w), max(3, repeats // 2)))
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    peak, how = theoretical_peak(cpuinfo, threads)
    size = n * 4
    bf16, layout = _bf16_seconds(x, w, max(3, repeats // 2))
    int8 = _int8_seconds(x, w, max(3, repeats // 2))
    return Machine(threads=threads, copy_gbs=2 * size / copy_s / 1e9, read_gbs=size / read_s / 1e9,
                   gemm_gflops=2 * gemm_n**3 / gemm_s / 1e9, gemm_n=gemm_n, stream_mib=stream_mib,
                   fma_peak_gflops=peak, fma_peak_how=how,
                   bf16_gflops=None if bf16 is None else 2 * gemm_n**3 / bf16 / 1e9, bf16_layout=layout,
                   int8_gops=None if int8 is None else 2 * gemm_n**3 / int8 / 1e9)


def _bf16_seconds(x: object, w: object, repeats: int) -> tuple[float | None, str]:
    """The native bf16 GEMM's best time for x @ w^T, and its layout; (None, "") where it is not built."""
    from noria.worker import gemm_bf16_kernels

    if gemm_bf16_kernels.load() is None:
        return None, ""
    packed = gemm_bf16_kernels.PackedHalfWeight(w)  # type: ignore[arg-type]
    return _best_seconds(lambda: gemm_bf16_kernels.gemm_bf16(x, packed, None), repeats), packed.kind  # type: ignore[arg-type]


def _int8_seconds(x: object, w: object, repeats: int) -> float | None:
    """The native W8A8 GEMM's best time for x @ w^T (activations quantized inside), None where not built."""
    import torch

    from noria.worker import gemm_quant_kernels

    if not gemm_quant_kernels.usable():
        return None
    q = torch.randint(-127, 128, w.shape, dtype=torch.int8)  # type: ignore[attr-defined]
    packed = gemm_quant_kernels.PackedInt8Weight(q, torch.rand(q.shape[0]) / 100)
    return _best_seconds(lambda: gemm_quant_kernels.gemm_w8a8(x, packed, None), repeats)  # type: ignore[arg-type]


def describe(m: Machine, what: str = "best of the job's measurements") -> str:
    peak = (f"{m.fma_peak_gflops:.0f} GFLOP/s theoretical FMA peak ({m.fma_peak_how}), "
            f"GEMM reaches {m.gemm_gflops / m.fma_peak_gflops:.0%} of it"
            # Under a hypervisor "cpu MHz" is the nominal clock; turbo runs above it.
            + (" (over 100%: the cores run above the nominal clock)" if m.gemm_gflops > m.fma_peak_gflops else "")
            if m.fma_peak_gflops else m.fma_peak_how)
    return (f"machine, measured with {m.threads} threads ({what}):\n"
            f"  stream copy_ {m.copy_gbs:.1f} GB/s (read + write, {m.stream_mib} MiB tensor), "
            f"read-only sum {m.read_gbs:.1f} GB/s\n"
            f"  float32 GEMM {m.gemm_gflops:.1f} GFLOP/s (best of torch.mm {m.gemm_n}^3 and "
            f"F.linear {m.gemm_n}x{m.gemm_n // 2} by {2 * m.gemm_n}x{m.gemm_n // 2}); {peak}"
            + (f"\n  bf16-weight GEMM ({m.bf16_layout}) {m.bf16_gflops:.1f} GFLOP/s on the F.linear shape"
               if m.bf16_gflops else "")
            + (f"\n  int8 GEMM (W8A8) {m.int8_gops:.1f} GOP/s on the F.linear shape" if m.int8_gops else ""))


def measure_in_child(threads: int) -> Machine:
    """`measure` in a fresh process with the worker's settings (see the module's docstring)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "noria.bench.roofline_machine", "--threads", str(threads),
                        "--out", out.name], check=True)
        return Machine(**json.loads(Path(out.name).read_text()))


def sustained(threads: int, seconds: float, window: float, gemm_n: int) -> list[float]:
    """GFLOP/s of back-to-back `torch.mm` (gemm_n^3) in each `window` seconds over `seconds`."""
    import torch

    torch.set_num_threads(threads)
    a, b, c = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n), torch.empty(gemm_n, gemm_n)
    rates: list[float] = []
    start = t0 = time.perf_counter()
    done = 0
    while time.perf_counter() - start < seconds:
        torch.mm(a, b, out=c)
        done += 1
        now = time.perf_counter()
        if now - t0 >= window:
            rates.append(2 * gemm_n**3 * done / (now - t0) / 1e9)
            print(f"{now - start:6.1f} s  {rates[-1]:6.1f} GFLOP/s", flush=True)
            t0, done = now, 0
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.roofline_machine")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (the worker's default: every core)")
    ap.add_argument("--stream-mib", type=int, default=256)
    ap.add_argument("--gemm-n", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the measurement here as JSON")
    ap.add_argument("--sustain", type=float, default=None, help="seconds of back-to-back GEMM, rate per window")
    ap.add_argument("--window", type=float, default=5.0)
    args = ap.parse_args(argv)
    if args.sustain:
        rates = sorted(sustained(args.threads, args.sustain, args.window, args.gemm_n))
        if rates:
            print(f"windows: min {rates[0]:.1f}, median {rates[len(rates) // 2]:.1f}, max {rates[-1]:.1f} GFLOP/s")
        return 0
    m = measure(args.threads, args.stream_mib, args.gemm_n)
    print(describe(m, "this measurement"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(m.to_json()))
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's OpenMP and allocator settings, before torch loads)

    raise SystemExit(main())
