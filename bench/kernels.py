"""`noria bench kernels`: attention kernel timings per shape.

On a GPU: the CUDA decode kernel (one query per sequence over the paged cache; for float16 /
bfloat16 the tensor-core GQA kernel, split as `plan_decode_split` balances the work; for
float32 the CUDA-core kernel, single pass or split-K as `choose_num_partitions` picks) in time
per step and GB/s of K/V read (each K/V byte once: what a kernel that shares loads across a
GQA group must reach), against the
device's peak (memory clock x bus width) and a device-to-device copy; then the ragged prefill
kernel in time and TFLOP/s.
Without a GPU the CUDA emulator is a correctness tool, not a performance target (it runs
every CUDA thread as a fiber), so the CPU run times what a CPU worker really uses instead:
the torch backend's native decode kernel (worker/cpu_kernels.py), in time and GB/s, with the
line "no GPU" saying so; `--emulated` runs the GPU rows there anyway, through the emulator at
whatever small shapes it is given, to check the harness (bin/gpu-session --dry-run).

`--mixed P+NxC` adds a mixed step (a P-token prompt chunk beside N decodes of context C) against
its two parts run apart; `--baselines` adds torch's attention on every decode and prefill shape
(SDPA's flash and cuDNN backends, torch's varlen FlashAttention, the flash_attn package where it
is importable: bench/kernel_rows.py).
"""

from __future__ import annotations

import argparse
import json

import torch

# (sequences, context) per decode row; (sequences, prompt) per prefill row.
GPU_DECODE = [(1, 1024), (8, 4096), (32, 2048), (64, 4096), (128, 1024), (256, 512), (4, 32768)]
GPU_PREFILL = [(1, 512), (4, 2048), (1, 8192)]
CPU_DECODE = [(1, 1024), (8, 1024), (32, 512)]


def _parse(rows: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (r.split("x") for r in rows.split(","))]


def gpu(args: argparse.Namespace) -> list[dict[str, object]]:
    from noria.bench import kernel_rows
    from noria.kernels.device_info import copy_gbps, decode_timing, device_facts, prefill_timing
    from noria.kernels.instances import AttentionConfig

    cfg = AttentionConfig(args.dtype, args.head_size, args.block_size)
    shape = (f"{args.dtype}, head size {args.head_size}, block size {args.block_size}, "
             f"{args.heads}/{args.kv_heads} query/KV heads")
    if args.emulated:
        dev, iters, peak, copy = torch.device("cpu"), 1, None, None
        print(f"emulated: the GPU rows under the CPU emulator (a check of the harness; the times are not "
              f"measurements); {shape}")
    else:
        dev, iters = torch.device("cuda"), 20
        facts = device_facts()
        peak, copy = facts.peak_gbps, copy_gbps()
        print(f"{facts.name} (sm_{facts.arch}, {facts.sm_count} SMs): peak {facts.peak_gbps:.0f} GB/s, "
              f"device copy {copy:.0f} GB/s (read + write); {shape}")
    elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()

    def pct(x: float | None, of: float | None) -> str:
        return f"{x / of:>7.0%}" if x and of else f"{'':>7}"

    def other(row: dict[str, object]) -> dict[str, object]:
        row = kernel_rows.rate(row, args.heads, args.kv_heads, args.head_size, elem)
        if row.get("us") is None:
            print(f"  {row['backend']:<24} n/a: {row.get('note', '')}")
        elif row["kind"] == "decode":
            print(f"  {row['backend']:<24} {row['us']:>10.1f} {row['gbps']:>8.0f} {pct(row['gbps'], peak)} "
                  f"{pct(row['gbps'], copy)} {row.get('note', '')}")
        else:
            print(f"  {row['backend']:<24} {row['us']:>10.1f} {row['tflops']:>8.1f} {row.get('note', '')}")
        return row

    print(f"{'decode':<10} {'seqs':>6} {'context':>8} {'us/step':>10} {'GB/s':>8} {'% peak':>7} {'% copy':>7}")
    rows: list[dict[str, object]] = []
    for seqs, ctx in _parse(args.decode) if args.decode else GPU_DECODE:
        t = decode_timing(cfg, seqs, ctx, args.heads, args.kv_heads, device=dev.type, iters=iters)
        print(f"{'':<10} {seqs:>6} {ctx:>8} {t.seconds * 1e6:>10.1f} {t.gbps:>8.0f} {pct(t.gbps, peak)} {pct(t.gbps, copy)}")
        rows.append({"kind": "decode", "backend": "noria", "seqs": seqs, "context": ctx, "us": t.seconds * 1e6,
                     "gbps": t.gbps, "of_copy": t.gbps / copy if copy else None})
        if args.baselines:
            found = kernel_rows.sdpa_rows("decode", seqs, ctx, args.heads, args.kv_heads, cfg, dev, iters)
            found.append(kernel_rows.flash_attn_decode_row(seqs, ctx, args.heads, args.kv_heads, cfg, dev, iters))
            rows += [other(r) for r in found]
    print(f"{'prefill':<10} {'seqs':>6} {'prompt':>8} {'us/step':>10} {'TFLOP/s':>8}")
    for seqs, prompt in _parse(args.prefill) if args.prefill else GPU_PREFILL:
        seconds, tflops = prefill_timing(cfg, seqs, prompt, args.heads, args.kv_heads, device=dev.type,
                                         iters=min(iters, 5))
        print(f"{'':<10} {seqs:>6} {prompt:>8} {seconds * 1e6:>10.1f} {tflops:>8.1f}")
        rows.append({"kind": "prefill", "backend": "noria", "seqs": seqs, "prompt": prompt, "us": seconds * 1e6,
                     "tflops": tflops})
        if args.baselines:
            found = kernel_rows.sdpa_rows("prefill", seqs, prompt, args.heads, args.kv_heads, cfg, dev, min(iters, 5))
            found += kernel_rows.varlen_rows(seqs, prompt, args.heads, args.kv_heads, cfg, dev, min(iters, 5))
            rows += [other(r) for r in found]
    if args.mixed:
        chunk, decodes, ctx = kernel_rows.parse_mixed(args.mixed)
        r = kernel_rows.mixed_row(cfg, chunk, decodes, ctx, args.heads, args.kv_heads, dev, min(iters, 5))
        print(f"mixed: a {chunk}-token chunk beside {decodes} decodes of context {ctx}: {r['us']:.1f} us in one step; "
              f"apart {r['decode_us']:.1f} (decode) + {r['prefill_us']:.1f} (prefill) us; "
              f"mixed / parts {r['mixed_over_parts']:.2f}")
        rows.append(r)
    return rows


def cpu(args: argparse.Namespace) -> list[dict[str, object]]:
    import time

    from noria.worker import cpu_kernels

    print("no GPU: the CUDA emulator is not a performance target; timing the CPU worker's native "
          f"decode kernel (worker/cpu_kernels.py), float32, {torch.get_num_threads()} threads")
    if cpu_kernels.load() is None:
        print("the native CPU kernel did not build here (no C compiler?): nothing to time")
        return []
    bs, d, h, kvh = args.block_size, args.head_size, args.heads, args.kv_heads
    print(f"{'decode':<10} {'seqs':>6} {'context':>8} {'us/step':>10} {'GB/s':>8}")
    rows: list[dict[str, object]] = []
    for seqs, ctx in _parse(args.decode) if args.decode else CPU_DECODE:
        per_seq = -(-ctx // bs)
        k = torch.randn(seqs * per_seq, bs, kvh, d)
        v = torch.randn_like(k)
        tables = torch.randperm(seqs * per_seq).view(seqs, per_seq)
        lens = torch.full((seqs,), ctx, dtype=torch.int64)
        q = torch.randn(seqs, h, d)
        cpu_kernels.paged_decode(q, k, v, tables, lens, 0.1, None)  # warm-up
        start, n = time.perf_counter(), 5
        for _ in range(n):
            cpu_kernels.paged_decode(q, k, v, tables, lens, 0.1, None)
        seconds = (time.perf_counter() - start) / n
        gbps = 2 * seqs * ctx * kvh * d * 4 / seconds / 1e9
        print(f"{'':<10} {seqs:>6} {ctx:>8} {seconds * 1e6:>10.1f} {gbps:>8.1f}")
        rows.append({"kind": "decode-cpu", "seqs": seqs, "context": ctx, "us": seconds * 1e6, "gbps": gbps})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", default=None, metavar="SxC,...", help="decode rows: sequences x context")
    ap.add_argument("--prefill", default=None, metavar="SxP,...", help="prefill rows (GPU): sequences x prompt")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"], help="GPU only")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--mixed", default=None, metavar="P+NxC", help="GPU: a mixed step, a P-token prompt chunk "
                    "beside N decodes of context C, against its two parts run apart")
    ap.add_argument("--baselines", action="store_true", help="GPU: torch's attention on the same shapes "
                    "(SDPA flash and cuDNN, varlen FlashAttention, flash_attn where importable)")
    ap.add_argument("--emulated", action="store_true", help="the GPU rows on the CPU under the CUDA emulator "
                    "(checks the harness at small shapes; the times are not measurements)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.mixed:
        from noria.bench.kernel_rows import parse_mixed

        try:
            parse_mixed(args.mixed)
        except ValueError as e:
            ap.error(str(e))
    rows = gpu(args) if torch.cuda.is_available() or args.emulated else cpu(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
