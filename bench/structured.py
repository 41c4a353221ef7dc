"""`noria bench structured`: what a structured-output constraint costs.

1. Per step, for N constrained requests: the scheduler's llguidance bitmask
   (`StructuredOutputManager.fill_bitmask`, matchers part-way into a document),
   the bytes it adds to the StepPlan, and the worker's masking of the logits
   (`apply_grammar_bitmask`), each the median of repeated runs.
2. W1 offline (`LLM.generate`, greedy, EOS ignored) with every request under a
   JSON schema against the same requests unconstrained, interleaved for --rounds;
   output tokens/s of the best round of each, and their ratio. The schema is an
   array of at least 64 small objects, so that no document completes before
   W1's output length and both runs generate the same tokens (printed for both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from noria.bench.workloads import CHECKPOINTS, w1

SCHEMA = {
    "type": "object",
    # minItems: no document completes within W1's output lengths, so both runs make the same tokens.
    "properties": {"log": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"step": {"type": "integer"}, "note": {"type": "string", "maxLength": 16},
                       "ok": {"type": "boolean"}},
        "required": ["step", "note", "ok"], "additionalProperties": False}}},
    "required": ["log"], "additionalProperties": False,
}
PREFIX = '{"log":[{"step":12,"note":"ab'  # where the per-step masks are measured (inside a string)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_costs(model: Path, tokenizer: str | None, sizes: list[int], repeats: int) -> list[dict]:
    import torch

    from noria.protocol.model_identity import model_facts
    from noria.protocol.structured import StructuredOutput
    from noria.scheduler.structured_output import StructuredOutputManager
    from noria.worker.grammar_mask import apply_grammar_bitmask

    vocab = model_facts(str(model)).vocab_size
    mgr = StructuredOutputManager(tokenizer or str(model), str(model), vocab)
    so = StructuredOutput(json=SCHEMA)
    mgr.submit(0, so, [])
    while not (ready := mgr.take_ready()):
        time.sleep(0.01)
    template = ready[0][1]
    tok = mgr._tokenizer
    for t in tok.tokenize_str(PREFIX):
        assert template.consume_token(t), "the prefix must be valid under the schema"
    mgr.fill_bitmask([(0, template.deep_copy())])  # warm-up: the executor's threads, numpy
    rows = []
    for n in sizes:
        matchers = [(i, template.deep_copy()) for i in range(n)]
        fill = _median_ms(lambda m=matchers: mgr.fill_bitmask(m), repeats)
        mask = mgr.fill_bitmask(matchers)
        logits = torch.randn(n, vocab)
        ids = list(range(n))
        apply = _median_ms(lambda lg=logits, mk=mask, rs=ids: apply_grammar_bitmask(lg, mk, rs), repeats)
        rows.append({"requests": n, "bitmask_ms": fill, "apply_ms": apply, "plan_bytes": len(mask.data)})
    mgr.close()
    return rows


def w1_runs(model: Path, num_requests: int, rounds: int, flags: dict) -> dict:
    from noria import LLM, SamplingParams
    from noria.protocol.model_identity import model_facts
    from noria.protocol.structured import StructuredOutput

    work = w1(model_facts(str(model)).vocab_size, num_requests)
    prompts = [p for p, _ in work]
    plain = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    so = StructuredOutput(json=SCHEMA)
    constrained = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, structured_output=so)
                   for _, m in work]
    best: dict[str, dict] = {}
    with LLM(str(model), **flags) as llm:
        llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up; compiles and caches the schema
        for _ in range(rounds):
            for name, params in (("unconstrained", plain), ("json_schema", constrained)):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
                run = {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt, "completed_docs": stopped}
                if name not in best or run["tok_s"] > best[name]["tok_s"]:
                    best[name] = run
                if name == "json_schema":
                    for o in outs:  # every document is a valid prefix; completed ones parse
                        if o.outputs[0].finish_reason == "stop":
                            json.loads(o.outputs[0].text)
    return best


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="small, serving, demo, or a checkpoint folder")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1,32,128", help="constrained requests per step for the step costs")
    ap.add_argument("--repeats", type=int, default=20)
    args, rest = ap.parse_known_args(argv)
    from noria.frontend.cli import add_engine_args, engine_flags
    from noria.frontend.demo_model import resolve_model

    eng = argparse.ArgumentParser()
    add_engine_args(eng)
    flags = engine_flags(eng.parse_args(rest))
    flags.setdefault("max_num_seqs", args.num_requests)
    model = CHECKPOINTS[args.model]() if args.model in CHECKPOINTS else Path(resolve_model(args.model))
    print(f"model {args.model} ({model}), tokenizer {flags.get('tokenizer') or 'of the model'}; "
          f"CPU: {_cpu()}, {os.cpu_count()} cores")
    print("\nper step: N constrained requests")
    print(f"{'N':>5} {'bitmask ms':>11} {'apply ms':>9} {'plan bytes':>11}")
    for r in step_costs(model, flags.get("tokenizer"), [int(s) for s in args.sizes.split(",")], args.repeats):
        print(f"{r['requests']:>5} {r['bitmask_ms']:>11.3f} {r['apply_ms']:>9.3f} {r['plan_bytes']:>11}")
    best = w1_runs(model, args.num_requests, args.rounds, flags)
    print(f"\nW1, {args.num_requests} requests, greedy, best of {args.rounds} round(s)")
    print(f"{'run':<14} {'tokens':>7} {'docs done':>9} {'seconds':>8} {'tok/s':>8}")
    for name, r in best.items():
        print(f"{name:<14} {r['tokens']:>7} {r['completed_docs']:>9} {r['seconds']:>8.2f} {r['tok_s']:>8.1f}")
    ratio = best["json_schema"]["tok_s"] / best["unconstrained"]["tok_s"]
    print(f"constrained / unconstrained tok/s: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
