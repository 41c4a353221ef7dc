"""Interleaved A/B of the CPU forward's linear and elementwise paths, in one process.

    python -m noria.bench.forward_ab [--rows 1,4,16,35,64,128,-512] [--threads 2] [--reps 9] [--clock wall|cpu]

Variants on the same loaded "small" model, alternated A, B, C, A, B, C ... per
batch shape, medians reported:
  old    oneDNN pre-packed weights (4-256 rows), torch RMSNorm / residual add / rotary;
  gemm   the native GEMM (worker/csrc/gemm_f32.c), torch elementwise ops;
  fused  the native GEMM and the fused RMSNorm+add and rotary+split (worker/csrc/fused_f32.c);
  stack  as fused, the layers in one native call per step (worker/native_stack.py; every other
         variant runs the modules' Python path);
  base   as fused, but the GEMM built from worker/csrc/gemm_f32.c at the git revision
         `--base-gemm REV` (e.g. `--base-gemm dd010a9 --variants base,fused`).
A positive row count is a decode batch of that many sequences with 300 tokens of
context each; a negative one a prefill of that many tokens in four prompts.
One step is the model plus the logits of every sequence and a greedy argmax.
`--clock cpu` times the process's CPU time, which other jobs on a busy machine
disturb far less than wall time (on a quiet one, use wall).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from noria.bench.ceiling import _metadata
from noria.bench.gemm_ab import base_dll
from noria.bench.workloads import small_checkpoint
from noria.frontend.startup import make_config
from noria.worker import fused_kernels, gemm_kernels
from noria.worker.attention import AttentionMetadata
from noria.worker.model_runner import ModelRunner
from noria.worker.models.layers import pack_linear_weight
from noria.worker.models.llama import LlamaForCausalLM


def _packings(model: LlamaForCausalLM, native: bool) -> list[tuple[object, str, object]]:
    """(module, attribute, packed weight) for every linear layer of the model."""
    out: list[tuple[object, str, object]] = []
    for layer in model.layers:
        for mod, name in ((layer.self_attn, "qkv"), (layer.self_attn, "o"), (layer.mlp, "gate_up"),
                          (layer.mlp, "down")):
            out.append((mod, f"{name}_packed", pack_linear_weight(getattr(mod, f"{name}_proj"), native=native)))
    out.append((model, "lm_head_packed", pack_linear_weight(model._lm_head_weight(), native=native)))
    return out


def _variants(model: LlamaForCausalLM, base_gemm: str | None) -> dict[str, Callable[[], None]]:
    onednn, native = _packings(model, False), _packings(model, True)
    usable, load = fused_kernels.usable, gemm_kernels.load
    base = None if base_gemm is None else base_dll(base_gemm)  # same panel layout, so the same packings

    def switch(packings: list, fused: bool, dll: object = None, stack: bool = False) -> Callable[[], None]:
        def apply() -> None:
            for mod, attr, packed in packings:
                setattr(mod, attr, packed)
            fused_kernels.usable = usable if fused else (lambda x: False)  # type: ignore[assignment]
            gemm_kernels.load = load if dll is None else (lambda: dll)  # type: ignore[assignment]
            if stack:
                model.__dict__.pop("_native_stack", None)
            else:
                model._native_stack = lambda *a: None  # type: ignore[method-assign]
        return apply

    out = {"old": switch(onednn, False), "gemm": switch(native, False), "fused": switch(native, True),
           "stack": switch(native, True, stack=True)}
    if base is not None:
        out["base"] = switch(native, True, base)
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.forward_ab")
    ap.add_argument("--rows", default="1,4,8,16,35,64,128,-512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--variants", default="old,gemm,fused")
    ap.add_argument("--base-gemm", default=None, help="git revision whose GEMM the variant `base` runs")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (all threads), which a busy machine disturbs far less")
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    runner = ModelRunner(make_config(str(small_checkpoint()), num_kv_blocks=2048, num_threads=args.threads))
    model = runner.model
    runner.kv_cache.device_cache.uniform_(-1, 1)  # real pages, not the shared zero page (see bench/ceiling.py)
    variants = _variants(model, args.base_gemm)
    labels = args.variants.split(",")
    totals = dict.fromkeys(labels, 0.0)
    print(f"threads {args.threads}, clock {args.clock}, ms per step (median)")
    print("| rows | " + " | ".join(labels) + f" | {labels[0]} / {labels[-1]} |")
    print("|---:|" + "---:|" * (len(labels) + 1))
    for rows in (int(r) for r in args.rows.split(",")):
        query = [1] * rows if rows > 0 else [-rows // 4] * 4
        seqs = [300] * rows if rows > 0 else query
        ids, meta = _metadata(runner, query, seqs)
        last = torch.tensor(meta.query_start_host[1:]) - 1

        def step(ids: torch.Tensor = ids, meta: AttentionMetadata = meta, last: torch.Tensor = last) -> None:
            hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
            model.compute_logits(hidden[last]).argmax(dim=-1).tolist()

        times: dict[str, list[float]] = {label: [] for label in labels}
        for label in labels:  # warm-up: first calls build caches
            variants[label]()
            step()
        for _ in range(args.reps):
            for label in labels:
                variants[label]()
                t0 = clock()
                step()
                times[label].append(clock() - t0)
        med = {label: sorted(v)[len(v) // 2] * 1e3 for label, v in times.items()}
        for label in labels:
            totals[label] += med[label]
        print(f"| {rows} | " + " | ".join(f"{med[label]:.1f}" for label in labels)
              + f" | {med[labels[0]] / med[labels[-1]]:.2f} |", flush=True)
    print("| sum | " + " | ".join(f"{totals[label]:.1f}" for label in labels)
          + f" | {totals[labels[0]] / totals[labels[-1]]:.2f} |")
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's thread and allocator settings, before torch works)

    raise SystemExit(main())
