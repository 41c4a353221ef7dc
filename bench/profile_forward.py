"""Operator profiles of vLLM CPU's and noria's forward on the same batches, side by side.

    python -m noria.bench.profile_forward [--batch 16 --prompt 128 --output 32] [--vllm vllm-tuned]

The workload is `--batch` requests with the same prompt length and output
length, all sent at once, so that both schedulers form the same batches: one
prefill of batch x prompt tokens (the token budget is raised to fit it), then
output - 1 decode steps of `--batch` rows whose contexts grow by one per step.

noria: `LLM.generate` records its steps (NORIA_RECORD_STEPS), which are then
replayed as bare forward passes (bench/ceiling.py) under torch.profiler, the
range "noria: forward" around the model and "noria: logits" around the LM head;
the native decode kernel (a ctypes call the profiler cannot see) is wrapped in
a range of its own. vLLM: the same requests through `LLM.generate` in its own
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
from pathlib import Path

# What each component's operators are called in either system (first match wins).
COMPONENTS: list[tuple[str, str]] = [
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


def profile_noria(path: Path, work: list, tmp: Path, num_kv_blocks: int) -> tuple[dict, int]:
    import torch

    from noria.bench.ceiling import read_steps, replay
    from noria.bench.throughput import run_noria_llm
    from noria.frontend.startup import make_config
    from noria.worker import cpu_kernels

    budget = max(2048, sum(len(p) for p, _ in work))
    flags = {"num_kv_blocks": num_kv_blocks, "max_num_batched_tokens": budget}
    row = run_noria_llm(path, work, flags, str(tmp / "noria.steps"))
    steps = read_steps(row["record"], row["record_skip"])
    native = cpu_kernels.paged_decode

    def paged_decode(*a, **k):  # the ctypes kernel is invisible to the profiler: name its range
        with torch.profiler.record_function("noria::paged_decode (native C)"):
            return native(*a, **k)

    cpu_kernels.paged_decode = paged_decode
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    try:
        replay(make_config(str(path), **flags), steps, around=lambda: prof)
    finally:
        cpu_kernels.paged_decode = native
    prof.export_chrome_trace(str(tmp / "noria.json"))
    return json.loads((tmp / "noria.json").read_text()), len(steps)


def profile_vllm(system: str, path: Path, work: list, tmp: Path) -> dict:
    from noria.bench import vllm_cpu

    folder = tmp / "vllm-trace"
    vllm_cpu.run_offline(system, path, work, profile=folder)
    traces = sorted(p for p in folder.rglob("*.json") if "profiler_out" not in p.name)
    if not traces:
        raise RuntimeError(f"vLLM wrote no trace into {folder}: {sorted(folder.rglob('*'))}")
    return json.loads(max(traces, key=lambda p: p.stat().st_size).read_text())


def table(noria: dict, vllm: dict | None, steps: int, vllm_name: str) -> str:
    empty = {"ms": 0.0, "calls": 0, "components": {}}
    nf, nl = noria.get("noria: forward", empty), noria.get("noria: logits", empty)
    vf = (vllm or {}).get("gpu_model_runner: forward", empty)
    vl = (vllm or {}).get("gpu_model_runner: postprocess", empty)  # vLLM computes the logits here
    cols = [(f"{vllm_name} forward", vf), ("noria forward", nf), (f"{vllm_name} logits (postprocess)", vl),
            ("noria logits", nl)]
    lines = [f"The same requests: noria's {steps} recorded steps replayed; {vllm_name}: "
             f"{vf.get('calls', 0)} forward calls in its worker. Self time, ms in total:", "",
             "| component | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    names = sorted({c for _, v in cols for c in v["components"]},
                   key=lambda c: -sum(v["components"].get(c, 0) for _, v in cols))
    for c in names:
        lines.append(f"| {c} | " + " | ".join(f"{v['components'].get(c, 0):.1f}" for _, v in cols) + " |")
    lines.append("| **total** | " + " | ".join(f"**{v['ms']:.1f}**" for _, v in cols) + " |")
    if vllm:
        lines += ["", f"{vllm_name}'s phases (ms): " + ", ".join(f"{p} {v['ms']:.1f}" for p, v in sorted(vllm.items()))]
    for who, phases in (("noria", noria), (vllm_name, vllm or {})):
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
        trace, steps = profile_noria(path, work, Path(tmp), args.num_kv_blocks)
        noria = summarize(self_times(trace, {"noria: forward", "noria: logits"}))
        vllm = None
        why = vllm_cpu.setup(install=False) if vllm_name != "none" else "not asked for"
        if why:
            print(f"vLLM not profiled: {why}")
        else:
            vllm = summarize(self_times(profile_vllm(vllm_name, path, work, Path(tmp)), VLLM_PHASES))
    text = table(noria, vllm, steps, vllm_name)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"workload": vars(args), "steps": steps, "noria": noria,
                                                    "vllm": vllm}, indent=2))
    return 0


if __name__ == "__main__":
    import noria.worker  # noqa: F401  (the worker's thread settings, before torch loads, as in the ceiling)

    raise SystemExit(main())
