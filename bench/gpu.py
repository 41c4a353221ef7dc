"""`noria bench gpu`: the engine on one GPU, against its HBM roofline and transformers, in under 8 minutes.

Writes (once, into the cache folder) the config and a word-level tokenizer of a bfloat16
Llama-3-8B-shaped model and serves it with `--load-format dummy`: seeded random weights made
directly on the device, so no 16 GB checkpoint is written or read; `--model PATH` measures a real
checkpoint instead. In order of value (a budget cut drops the last): inter-token latency at batch
1, 16 and 32 with CUDA graphs; decode throughput at batch 1 and 32 and a short offline run in the
model's dtype, with `--quantization fp8` and as a W4A16 int4 model (bench/gpu_quant.py); offline
throughput (256 requests x 1024 prompt / 256 output tokens, EOS ignored); TTFT of one 2k and one
8k prompt; the anchor, Hugging Face transformers `generate` with a static cache on the same
shape and GPU, at batch 1 and 16, eager and (where it works) compiled; and eager decode.

Every figure stands beside its floor: the bytes a step must read (weights, plus the K/V of every
sequence in it) over the measured device-to-device copy bandwidth, or, for a prefill, its matmul
FLOPs over the measured bfloat16 matmul rate when that is slower. Each phase runs under a time
budget (SIGALRM) so that the whole stays within `--time-budget` seconds; a phase that does not
fit is reported as skipped, one that overruns as cut short. OUT.json and OUT.md are rewritten
after every measurement, so a run killed midway still leaves what it measured.

On a host without a GPU it prints one line saying so and exits 0 (nothing to measure is not a
failure for a script that runs every benchmark). `--tiny` runs the same phases on a tiny model
at tiny sizes, on the CPU if there is no GPU: the harness's check, not a measurement.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from noria.bench.gpu_budget import PHASES, TINY_SIZES, Budget, PhaseTimeout, Sizes
from noria.bench.gpu_checkpoint import CHECKPOINT_VERSION, LLAMA3_8B, TINY, build_checkpoint
from noria.bench.gpu_phases import (
    eager_phase,
    engine_flags,
    hf_phase,
    itl_phase,
    spec_phase,
    throughput_phases,
)
from noria.bench.gpu_probes import probe_copy_gbps, probe_matmul_tflops
from noria.bench.gpu_quant import measure, quant_phases
from noria.bench.gpu_report import Report, Row, speedups
from noria.bench.gpu_roofline import (
    ModelCost,
    decode_step_floor,
    itl_floor,
    model_cost,
    prefill_floor,
    throughput_ceiling,
)
from noria.protocol.model_spec import read_spec

# The benchmark's parts, reachable from its entry point as one surface.
__all__ = ["CHECKPOINT_VERSION", "LLAMA3_8B", "PHASES", "TINY", "TINY_SIZES", "Budget", "ModelCost", "PhaseTimeout",
           "Report", "Row", "Sizes", "build_checkpoint", "decode_step_floor", "hf_phase", "itl_floor", "main",
           "model_cost", "prefill_floor", "probe_copy_gbps", "probe_matmul_tflops", "speedups",
           "throughput_ceiling"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local checkpoint folder; default: a Llama-3-8B-shaped config "
                    "served with --load-format dummy (random weights made on the device)")
    ap.add_argument("--load-format", default=None, choices=["auto", "dummy"], help="default: dummy for the "
                    "built config, auto (the checkpoint's weights) for --model")
    ap.add_argument("--tiny", action="store_true", help="a tiny model at tiny sizes (checks the harness; on the "
                    "CPU where there is no GPU)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="cpu only with --tiny or --model (a dry run of the harness)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds for every phase together "
                    "(default 450: the run ends within 8 minutes)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--out", default="bench/results/gpu", help="writes OUT.json and OUT.md as it goes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    only = {p.strip() for p in args.phases.split(",") if p.strip()}
    if unknown := only - set(PHASES):
        ap.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")

    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("noria bench gpu: no GPU on this host (torch sees no CUDA device); nothing measured")
        return 0
    if args.device == "cpu" and not (args.tiny or args.model):
        print("noria bench gpu: no GPU on this host (torch sees no CUDA device); nothing measured "
              "(--tiny checks the harness on the CPU)")
        return 0
    if args.device == "cpu" and args.dtype != "float32" and args.tiny:
        args.dtype = "float32"  # the CPU worker's dtype; the harness, not the numbers, is under test
    dev = torch.device(args.device)
    sizes = TINY_SIZES if args.tiny else Sizes()
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (harness check, not a measurement)"
    rep = Report(Path(args.out), {"device": device_name, "dtype": args.dtype, "model": args.model or "?",
                                  "sizes": {k: v for k, v in asdict(sizes).items() if k not in ("need", "cap")},
                                  "time_budget_s": args.time_budget, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    budget = Budget(args.time_budget, rep, sizes, only)
    print(f"noria bench gpu on {device_name}: budget {args.time_budget:.0f} s; writing {rep.md_path}", flush=True)

    gbps, tflops = 0.0, None
    with budget.phase("probe") as go:
        if go:
            gbps = probe_copy_gbps(dev, (1 << 30) if dev.type == "cuda" else (32 << 20))
            rep.meta["copy_gbps"] = gbps
            tflops = probe_matmul_tflops(dev, getattr(torch, args.dtype), 8192 if dev.type == "cuda" else 256)
            rep.meta["matmul_tflops"] = tflops
            rep.add(Row("probe", "device copy (read + write)", gbps, "GB/s"))
            rep.add(Row("probe", f"{args.dtype} matmul", tflops, "TFLOP/s"))
    if not gbps:
        gbps = 1.0  # no probe: floors are placeholders, and say so
        rep.meta["copy_gbps"] = "not measured (floors use 1 GB/s)"

    model = args.model
    with budget.phase("checkpoint") as go:
        if go and model is None:
            from noria.protocol import switches

            shape = TINY if args.tiny else LLAMA3_8B
            name = f"bench-gpu-{'tiny' if args.tiny else 'llama3-8b'}-{args.dtype}-config-v{CHECKPOINT_VERSION}"
            start = time.perf_counter()
            model = str(build_checkpoint(switches.cache_dir() / name, shape, args.dtype, dev, args.seed, weights=False))
            rep.add(Row("checkpoint", "write (or find) the config and tokenizer", time.perf_counter() - start, "s",
                        note=model))
    if model is None:
        print("noria bench gpu: no checkpoint (the build was skipped or failed); see", rep.md_path)
        return 0
    load_format = args.load_format or ("auto" if args.model else "dummy")
    rep.meta["model"], rep.meta["load_format"] = model, load_format
    spec = read_spec(model)
    cost = model_cost(spec, torch.tensor([], dtype=getattr(torch, args.dtype)).element_size())
    rep.meta["weight_gb"] = cost.weight_bytes / 1e9
    rep.meta["kv_bytes_per_token"] = cost.kv_bytes_per_token
    rep.flush()

    flags = engine_flags(args, sizes, spec, load_format)

    off: dict[int, float] = {}  # the itl phase's ITL by batch: what the spec rows compare with

    def baseline(llm: object, itl: dict[int, float]) -> None:  # the quantized rows' baseline, on the itl engine
        off.update(itl)
        measure(rep, "itl", args.dtype, llm, args, sizes, spec, cost, gbps, tflops, itl)

    itl_phase(budget, rep, args, sizes, model, cost, spec, gbps, flags, after=baseline)
    quant_phases(budget, rep, args, sizes, model, spec, gbps, tflops, flags)
    throughput_phases(budget, rep, args, sizes, model, cost, spec, gbps, tflops, flags)
    spec_phase(budget, rep, args, sizes, model, spec, flags, off)
    hf_phase(budget, rep, args, sizes, model, cost, spec, gbps, dev)
    eager_phase(budget, rep, args, sizes, model, cost, spec, gbps, flags)
    for r in speedups(rep.rows):
        rep.add(r)
    print(rep.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
