"""The CPU GEMM over 16-bit weights against the float32 one, on the "small" model's shapes.

`python -m noria.bench.gemm_bf16`: per shape (K = 768; N = 1536 qkv, 768 o, 4096 gate_up,
32000 lm head) and row count, the median time of each native kernel (worker/gemm_kernels.py,
and worker/gemm_bf16_kernels.py in each layout this CPU builds: bf16 "widen", float16 "f16",
bf16 "dot" with AVX512_BF16, and "amx" beside it with AMX-BF16), its GFLOP/s, and float32 time over each 16-bit kernel's. Decode is bound by the
weight bytes, so the ratios at few rows should approach 2; many rows are bound by arithmetic,
where "dot" multiplies twice as fast. On a loaded machine, --threads 1: a descheduled OpenMP
thread holds every call up by a time slice.

`--engine`: the same comparison through the whole engine, one request alone (where the weight
bytes decide): `LLM.generate` on the "small" model with `--dtype float32`, `bfloat16` and
`float16` (16-bit weights, float32 activations), milliseconds per output token after the first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from noria.worker import gemm_bf16_kernels, gemm_kernels

K = 768
SHAPES = {"qkv": 1536, "o": 768, "gate_up": 4096, "lm_head": 32000}
ROWS = [1, 8, 32, 128]
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16")


def cpu_facts() -> str:
    """The CPU's model name and its flags of interest (avx2, avx512f, avx512_bf16, amx*)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "").split()
    have = [f for f in FLAGS_OF_INTEREST if f in flags] + [f for f in flags if f.startswith("amx")]
    lacks = [f for f in FLAGS_OF_INTEREST if f not in flags] + ([] if any(f.startswith("amx") for f in flags)
                                                               else ["amx"])
    return (f"{name}, {torch.get_num_threads()} threads; has: {' '.join(have) or '-'}; "
            f"lacks: {' '.join(lacks) or '-'}")


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: torch's count)")
    parser.add_argument("--engine", action="store_true", help="batch-1 inter-token latency through LLM.generate")
    args = parser.parse_args(argv)
    if args.engine:
        print(cpu_facts())
        for dtype in ("float32", "bfloat16", "float16") * 2:  # interleaved
            print(f"{dtype:<9} {engine_ms_per_token(dtype):6.2f} ms per output token, one request alone")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if gemm_kernels.load() is None or gemm_bf16_kernels.load() is None:
        print("the native GEMMs are not built (no C compiler, or the gemm family is on torch)")
        return 1
    print(cpu_facts())
    layouts = ["widen", "f16"] + (["dot", "amx"] if gemm_bf16_kernels.layout() == "amx"
                                  else [gemm_bf16_kernels.layout()] if gemm_bf16_kernels.layout() == "dot" else [])
    print(f"{'layer':<8} {'N':>6} {'rows':>5} {'f32 ms':>8} {'GFLOP/s':>8}"
          + "".join(f" {name + ' ms':>9} {'GFLOP/s':>8} {'f32/' + name:>9}" for name in layouts))
    torch.manual_seed(0)
    for layer, n in SHAPES.items():
        weight = torch.randn(n, K)
        f32 = gemm_kernels.PackedWeight(weight)
        bf16 = [gemm_bf16_kernels.PackedHalfWeight(weight, name) for name in layouts]
        for rows in ROWS:
            x = torch.randn(rows, K)
            flop = 2 * rows * n * K
            t32 = median_seconds(lambda: gemm_kernels.gemm(x, f32, None), args.repeats)  # noqa: B023
            line = f"{layer:<8} {n:>6} {rows:>5} {t32 * 1e3:>8.3f} {flop / t32 / 1e9:>8.1f}"
            for w in bf16:
                t16 = median_seconds(lambda: gemm_bf16_kernels.gemm_bf16(x, w, None), args.repeats)  # noqa: B023
                line += f" {t16 * 1e3:>9.3f} {flop / t16 / 1e9:>8.1f} {t32 / t16:>9.2f}"
            print(line)
    return 0


def engine_ms_per_token(dtype: str, tokens: int = 256) -> float:
    """One greedy request of `tokens` + 1 tokens, less the time to its first token, per token."""
    from noria import LLM, SamplingParams
    from noria.bench.workloads import CHECKPOINTS

    with LLM(str(CHECKPOINTS["small"]()), dtype=dtype, num_kv_blocks=512, seed=0) as llm:
        def run(n: int) -> float:
            start = time.perf_counter()
            llm.generate([[9, 10, 11, 12]], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                         use_tqdm=False)
            return time.perf_counter() - start

        run(16)  # warm: the kernels' first calls
        return (run(tokens + 1) - run(1)) / tokens * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
