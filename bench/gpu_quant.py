"""`noria bench gpu`'s quantized rows: decode throughput at batch 1 and 32 and a short offline run
in the model's dtype, with `--quantization fp8` (online per-channel e4m3 weights: the torch
_scaled_mm kind on sm_89+) and as a W4A16 model (compressed-tensors pack-quantized, int4 in groups
of 128: the CuPy dequant-GEMM kind), each against its weights-read roofline, and each quantized
kind's ratio to the model's dtype, which issue 39's target reads (FP8 >= 1.6x bf16 on the 8B shape).

The W4A16 model is the benchmark's own config with a quantization_config and no weights: it runs
with `--load-format dummy` (random valid int4 values and group scales made on the device), so no
quantized checkpoint is written or read, whatever `--model` is."""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from noria.bench.gpu_budget import Budget, Sizes
from noria.bench.gpu_checkpoint import W4A16_CONFIG, quantized_variant
from noria.bench.gpu_phases import _itl, _noria_run, _prompt_vocab, _prompts, decode_flags
from noria.bench.gpu_report import Report, Row
from noria.bench.gpu_roofline import ModelCost, itl_floor, model_cost, throughput_ceiling
from noria.protocol.model_spec import ModelSpec

FP8 = "fp8 online per-channel"
W4A16 = "w4a16 int4"


def w4a16_group(spec: ModelSpec) -> int:
    """128 (llm-compressor's preset) where the layers divide it; the tiny harness model takes 32."""
    dims = (spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim)
    return 128 if all(d % 128 == 0 for d in dims) else 32


def kind_cost(spec: ModelSpec, dtype_bytes: int, kind: str) -> ModelCost:
    if kind == FP8:  # e4m3 values, a float32 scale per output row
        return model_cost(spec, dtype_bytes, linear_bits=8)
    if kind == W4A16:
        return model_cost(spec, dtype_bytes, linear_bits=4, scale_group=w4a16_group(spec))
    return model_cost(spec, dtype_bytes)


def decode_name(batch: int, label: str) -> str:
    return f"decode batch {batch} ({label})"


def ratio_name(batch: int, label: str, base: str) -> str:
    return f"decode batch {batch}: {label} / {base}"


def measure(rep: Report, phase: str, label: str, llm: Any, args: argparse.Namespace, sizes: Sizes, spec: ModelSpec,
            cost: ModelCost, gbps: float, tflops: float | None, itl: dict[int, float] | None = None) -> None:
    """Decode throughput at each of `sizes.quant_batches` (from `itl`, seconds per step, where the
    engine measured it already) and the short offline run, each beside its roofline."""
    import numpy as np

    vocab, rng = _prompt_vocab(spec), np.random.default_rng(args.seed + 5)
    ctx = sizes.itl_prompt + sizes.itl_tokens // 2
    run = lambda ps, n: _noria_run(llm, ps, n)  # noqa: E731 - the measuring helpers take a callable
    for batch in sizes.quant_batches:
        s = (itl or {}).get(batch) or _itl(run, rng, batch, sizes, vocab)
        rep.add(Row(phase, decode_name(batch, label), batch / s, "tok/s", batch / itl_floor(cost, batch, ctx, gbps),
                    f"weights {cost.weight_bytes / 1e9:.2f} GB; context ~{ctx}"))
    n, p, o = sizes.quant_requests, sizes.quant_prompt, sizes.quant_output
    seconds, tokens = _noria_run(llm, _prompts(rng, n, p, vocab), o)
    ceiling = throughput_ceiling(cost, n, p, o, min(n, llm.config.max_num_seqs), gbps, tflops)
    rep.add(Row(phase, f"offline {n} x {p}/{o} ({label})", tokens / seconds, "tok/s", ceiling,
                f"{tokens} tokens in {seconds:.1f} s; prefill floor at the {args.dtype} matmul rate"))


def ratios(rep: Report, phase: str, label: str, base: str, sizes: Sizes) -> None:
    """`label`'s decode throughput over `base`'s at each batch both have."""
    values = {r.name: r.value for r in rep.rows}
    for batch in sizes.quant_batches:
        mine, theirs = values.get(decode_name(batch, label)), values.get(decode_name(batch, base))
        if mine and theirs:
            rep.add(Row(phase, ratio_name(batch, label, base), mine / theirs, "x", None,
                        "issue 39: FP8 >= 1.6x" if label == FP8 else "above 1: faster than " + base))


def quant_phases(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, spec: ModelSpec,
                 gbps: float, tflops: float | None, flags: dict[str, Any]) -> None:
    """The fp8 and w4a16 phases, each on an engine of its own (started, measured, shut down)."""
    from noria import LLM

    dtype_bytes = 4 if args.dtype == "float32" else 2
    scratch = Path(tempfile.mkdtemp(prefix="bench-gpu-w4a16-"))
    try:
        for phase, label in (("fp8", FP8), ("w4a16", W4A16)):
            with b.phase(phase) as go:
                if not go:
                    continue
                if phase == "fp8":
                    path, kind_flags = model, flags | {"quantization": "fp8"}
                else:  # the same shape as a W4A16 model: config only, dummy int4 weights
                    qconfig = copy.deepcopy(W4A16_CONFIG)
                    qconfig["config_groups"]["group_0"]["weights"]["group_size"] = w4a16_group(spec)
                    path = str(quantized_variant(Path(model), scratch / "model", qconfig))
                    kind_flags = flags | {"load_format": "dummy"}
                llm = None
                try:
                    start = time.perf_counter()
                    llm = LLM(path, **decode_flags(kind_flags, sizes))
                    rep.add(Row(phase, f"engine start ({label})", time.perf_counter() - start, "s"))
                    _noria_run(llm, [[5] * 16, [6] * 16], 2)  # warm-up
                    measure(rep, phase, label, llm, args, sizes, spec, kind_cost(spec, dtype_bytes, label), gbps, tflops)
                    ratios(rep, phase, label, args.dtype, sizes)
                finally:
                    if llm is not None:
                        llm.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
