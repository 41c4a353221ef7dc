"""Operator profiles of vLLM CPU's and noria's forward on the same batches, side by side.

    python -m noria.bench.profile_forward [--batch 16 --prompt 128 --output 32] [--vllm vllm-tuned]

The workload is `--batch` requests with the same prompt length and output
length, all sent at once, so that both schedulers form the same batches: one
prefill of batch x prompt tokens (the token budget is raised to fit it), then
output - 1 decode steps of `--batch` rows whose contexts grow by one per step.

noria: `LLM.generate` records its steps (NORIA_RECORD_STEPS), which are then
replayed as bare forward passes (bench/ceiling.py) under torch.profiler, the
range "noria: forward" around the model and "noria: logits" around the LM head.
The native kernels are ctypes calls the profiler cannot see: each is wrapped in
a range of its own. The replay runs twice: as noria runs it (the decoder stack
in one native call where it applies: one range for all layers), then with the
stack off, so the same kernels are called one by one from Python and each
shows as a component. vLLM: the same requests through `LLM.generate` in its own
venv under its own torch profiler, in its worker process, with its phase ranges
("gpu_model_runner: forward", "...: sample", ...).

Both Chrome traces are reduced the same way: self time per operator (its time
less its child operators'), summed per phase and per component (GEMM,
attention, norms, ...). A range's own time is time inside it that no operator
accounts for: Python, and on the noria side nothing else, since its kernels are
wrapped. Writes OUT.md (tables) and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

# What each component's operators are called in either system (first match wins).
COMPONENTS: list[tuple[str, str]] = [
    ("decoder stack (native, all layers in one call)", r"decoder stack"),
    ("attention", r"attn|attention|paged|sdpa|scaled_dot_product|flash"),
    ("KV cache write", r"reshape_and_cache|write_kv|index_put|index_copy|scatter"),
    ("GEMM", r"\bmm\b|aten::mm|addmm|matmul|linear|bmm|onednn|mkldnn|dnnl|gemm"),
    ("RMSNorm", r"rms|norm"),
    ("SiLU and mul", r"silu|gelu|act_and_mul|sigmoid"),
    ("rotary", r"rotary|rope"),
    ("logits, sampling", r"softmax|argmax|topk|sort|sampl|logit|log_softmax|multinomial"),
    ("compiled region (inductor kernels)", r"compiled|inductor|cpp_fused|graph_"),
    ("copies, layout, indexing", r"copy|contiguous|\bcat\b|aten::cat|clone|empty|stack|permute|index|gather|"
                                 r"slice|select|view|reshape|transpose|expand|aten::to\b|_to_copy|fill|zero"),
    ("elementwise", r"add|mul|div|sub|pow|rsqrt|mean|neg|exp|sum|where|cumsum|arange|full"),
]
RANGE_OWN = "range's own time (Python)"


def component(name: str) -> str:
    for label, pattern in COMPONENTS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def self_times(trace: dict, phases: set[str]) -> dict[str, dict[str, list[float]]]:
    """{phase: {operator: [self microseconds, calls]}} over the events nested in a phase range.

    Operators and ranges (`cpu_op`, `user_annotation` events) are nested per
    thread by their start and duration; each gets its duration less its direct
    children's. Events outside every phase range are left out."""
    kept = [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in kept:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for events in by_thread.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[dict, str | None, list[float]]] = []  # (event, its phase, [self us])

        def close(item: tuple[dict, str | None, list[float]]) -> None:
            e, phase, own = item
            if phase is not None:
                name = RANGE_OWN if e["name"] in phases else e["name"]
                slot = out[phase][f"{name} [{e['name']}]" if name == RANGE_OWN else name]
                slot[0] += own[0]
                slot[1] += 1

        for e in events:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and float(stack[-1][0]["ts"]) + float(stack[-1][0]["dur"]) <= ts:
                close(stack.pop())
            parent_phase = stack[-1][1] if stack else None
            phase = parent_phase or (e["name"] if e["name"] in phases else None)
            if stack:
                stack[-1][2][0] -= dur
            stack.append((e, phase, [dur]))
        while stack:
            close(stack.pop())
    return out


def summarize(ops: dict[str, dict[str, list[float]]]) -> dict:
    """Per phase: total ms, ms per component, the top operators."""
    result = {}
    for phase, table in ops.items():
        comps: dict[str, float] = defaultdict(float)
        for name, (us, _) in table.items():
            comps["Python, around operators" if name.startswith(RANGE_OWN) else component(name)] += us / 1000
        top = sorted(((n, us / 1000, c) for n, (us, c) in table.items()), key=lambda x: -x[1])[:15]
        result[phase] = {"ms": sum(comps.values()), "calls": int(table.get(f"{RANGE_OWN} [{phase}]", [0, 0])[1]),
                         "components": dict(comps),
                         "top": [{"op": n, "ms": ms, "calls": c} for n, ms, c in top]}
    return result


def uniform_work(batch: int, prompt: int, output: int, vocab: int = 32000) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(3, vocab) for _ in range(prompt)], output) for _ in range(batch)]


def _named_native_kernels(stack: bool) -> list[tuple[object, str, object]]:
    """Wrap each native kernel's Python entry in a profiler range (ctypes calls are invisible
    to the profiler); with `stack` False the one-call decoder stack is declined, so that the
    layers run kernel by kernel. Returns what to put back."""
    import torch

    from noria.worker import cpu_kernels, fused_kernels, gemm_kernels, native_stack

    def named(fn: Callable, label: str) -> Callable:
        def call(*a: object, **k: object) -> object:
            with torch.profiler.record_function(f"noria::{label} (native C)"):
                return fn(*a, **k)
        return call

    wrapped = [(cpu_kernels, "paged_decode", "paged_decode"), (gemm_kernels, "gemm", "gemm"),
               (fused_kernels, "add_rms_norm", "add_rms_norm"), (fused_kernels, "rope_split", "rope_split"),
               (fused_kernels, "silu_mul", "silu_mul"), (native_stack.NativeStack, "run", "decoder stack")]
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in wrapped]
    saved.append((native_stack.NativeStack, "applies", native_stack.NativeStack.__dict__["applies"]))
    for owner, attr, label in wrapped:
        setattr(owner, attr, named(getattr(owner, attr), label))
    if not stack:
        native_stack.NativeStack.applies = staticmethod(lambda *a: False)
    return saved


def profile_noria(path: Path, work: list, tmp: Path, num_kv_blocks: int) -> tuple[dict, dict, int]:
    """Chrome traces of the recorded steps replayed as noria runs them, and with the stack off."""
    import torch

    from noria.bench.ceiling import read_steps, replay
    from noria.bench.throughput import run_noria_llm
    from noria.frontend.startup import make_config

    budget = max(2048, sum(len(p) for p, _ in work))
    flags = {"num_kv_blocks": num_kv_blocks, "max_num_batched_tokens": budget}
    row = run_noria_llm(path, work, flags, str(tmp / "noria.steps"))
    steps = read_steps(row["record"], row["record_skip"])
    traces = []
    for stack in (True, False):
        saved = _named_native_kernels(stack)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        try:
            replay(make_config(str(path), **flags), steps, around=lambda p=prof: p)
        finally:
            for owner, attr, value in saved:
                setattr(owner, attr, value)
        out = tmp / f"noria-{'stack' if stack else 'kernels'}.json"
        prof.export_chrome_trace(str(out))
        traces.append(json.loads(out.read_text()))
    return traces[0], traces[1], len(steps)


def profile_vllm(system: str, path: Path, work: list, tmp: Path) -> dict:
    from noria.bench import vllm_cpu

    folder = tmp / "vllm-trace"
    vllm_cpu.run_offline(system, path, work, profile=folder)
    traces = sorted(p for p in folder.rglob("*.json") if "profiler_out" not in p.name)
    if not traces:
        raise RuntimeError(f"vLLM wrote no trace into {folder}: {sorted(folder.rglob('*'))}")
    return json.loads(max(traces, key=lambda p: p.stat().st_size).read_text())


def table(noria: dict, kernels: dict, vllm: dict | None, steps: int, vllm_name: str) -> str:
    empty = {"ms": 0.0, "calls": 0, "components": {}}
    vf = (vllm or {}).get("gpu_model_runner: forward", empty)
    vl = (vllm or {}).get("gpu_model_runner: postprocess", empty)  # vLLM computes the logits here
    cols = [(f"{vllm_name} forward", vf), ("noria forward", noria.get("noria: forward", empty)),
            ("noria forward, kernel by kernel", kernels.get("noria: forward", empty)),
            (f"{vllm_name} logits (postprocess)", vl), ("noria logits", noria.get("noria: logits", empty))]
    lines = [f"The same requests: noria's {steps} recorded steps replayed (as it runs them, then with the "
             f"decoder stack off so that each kernel shows); {vllm_name}: {vf.get('calls', 0)} forward calls "
             "in its worker. Self time, ms in total:", "",
             "| component | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    names = sorted({c for _, v in cols for c in v["components"]},
                   key=lambda c: -sum(v["components"].get(c, 0) for _, v in cols))
    for c in names:
        lines.append(f"| {c} | " + " | ".join(f"{v['components'].get(c, 0):.1f}" for _, v in cols) + " |")
    lines.append("| **total** | " + " | ".join(f"**{v['ms']:.1f}**" for _, v in cols) + " |")
    if vllm:
        lines += ["", f"{vllm_name}'s phases (ms): " + ", ".join(f"{p} {v['ms']:.1f}" for p, v in sorted(vllm.items()))]
    for who, phases in (("noria", noria), ("noria kernel by kernel", kernels), (vllm_name, vllm or {})):
        for phase, v in sorted(phases.items()):
            lines += ["", f"Top operators, {who}, {phase}:", "", "| operator | ms | calls |", "|---|---:|---:|"]
            lines += [f"| `{t['op']}` | {t['ms']:.2f} | {t['calls']} |" for t in v["top"]]
    return "\n".join(lines) + "\n"


VLLM_PHASES = {"gpu_model_runner: preprocess", "gpu_model_runner: forward", "gpu_model_runner: postprocess",
               "gpu_model_runner: sample", "gpu_model_runner: bookkeep", "gpu_model_runner: ModelRunnerOutput"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.profile_forward")
    ap.add_argument("--model", default="small", help="a benchmark model: small or serving")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--vllm", default="vllm-tuned", help="the vLLM configuration to profile, or 'none'")
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/profile-forward")
    args = ap.parse_args(argv)
    from noria.bench import vllm_cpu
    from noria.bench.workloads import CHECKPOINTS

    path = CHECKPOINTS[args.model]()
    work = uniform_work(args.batch, args.prompt, args.output)
    vllm_name = args.vllm
    with tempfile.TemporaryDirectory() as tmp:
        trace, by_kernel, steps = profile_noria(path, work, Path(tmp), args.num_kv_blocks)
        phases = {"noria: forward", "noria: logits"}
        noria, kernels = summarize(self_times(trace, phases)), summarize(self_times(by_kernel, phases))
        vllm = None
        why = vllm_cpu.setup(install=False) if vllm_name != "none" else "not asked for"
        if why:
            print(f"vLLM not profiled: {why}")
        else:
            vllm = summarize(self_times(profile_vllm(vllm_name, path, work, Path(tmp)), VLLM_PHASES))
    text = table(noria, kernels, vllm, steps, vllm_name)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"workload": vars(args), "steps": steps, "noria": noria,
                                                    "noria_kernel_by_kernel": kernels, "vllm": vllm}, indent=2))
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's thread settings, before torch loads, as in the ceiling)

    raise SystemExit(main())
