"""`noria bench spec`: speculative decoding against none, in one job, rounds interleaved.

Per configuration (`off`; n-gram prompt lookup with k tokens, `ngram-k`; suffix decoding proposing
up to k, `suffix-k`; a draft model proposing
k tokens: the target itself, `self-k`, or its first L layers, `headL-k`; a random EAGLE-3 head,
`eagle3-k`, which measures what a head costs when it is always wrong; the same model as a MiMo
checkpoint drafting with its random MTP layer, `mtp-k`, the same measure for it), `LLM.generate` on
the "small" Llama (or, `--inert-after L`, the same model with its layers from L on adding
nothing, which its L-layer head drafts perfectly: bench/spec_models.py) in the dtype given (bf16
by default, as checkpoints ship):

- `itl_b1`: one request alone (W1's first prompts, greedy, EOS ignored): ms per output token of
  its decode, (time for 1 + T tokens - time for 1 token) / T, median over the prompts;
- `itl_b8`: eight such requests together, the same per step;
- `b32`: 32 W1 requests of T tokens at once, output tok/s (speculation must not cost here);
- `w1`: W1 (128 requests, greedy), output tok/s;
- `w1_sampled`: W1 at temperature 1 (seeded), whose outputs repeat far less: drafts mostly fail.

Beside each: drafts verified, the draft tokens accepted per draft (the mean acceptance length),
the accepted share of drafted tokens and the acceptance rate per draft position.

`llama.cpp-off`, `llama.cpp-ngram-k`, `llama.cpp-headL-k` and `llama.cpp-self-k` run llama.cpp's
own server with its own speculation on the same model and requests (bench/spec_llama_cpp.py says
how), skipped with one line where llama.cpp cannot be built. How the workloads repeat: the models are seeded
random weights, whose greedy outputs fall into loops of one to a few tokens within a few dozen
tokens of any prompt; the n-gram lookup finds those loops, so greedy rows show what drafts that
are mostly right buy, and the sampled row what drafts that are mostly wrong cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from noria.bench import spec_llama_cpp
from noria.bench.plots import pyplot, save_rows
from noria.bench.spec_models import (
    eagle3_checkpoint,
    head_checkpoint,
    inert_checkpoint,
    mimo_checkpoint,
)
from noria.bench.workloads import CHECKPOINTS, w1


def _config(name: str, lookup: tuple[int, int], model: Path | None = None) -> dict[str, Any] | None:
    """`off`, `ngram-K`, `suffix-K`, `self-K` (the target drafts for itself), `headL-K` (a draft
    of the target's first L layers), `eagle3-K` (a random EAGLE-3 head: bench/spec_models.py) or
    `mtp-K` (the target as a MiMo checkpoint, its random MTP layer drafting: run_config serves
    that copy); `model` None only checks the name."""
    if name == "off":
        return None
    if spec_llama_cpp.is_llama_cpp(name):
        spec_llama_cpp.method_of(name)
        return None
    method, _, k = name.rpartition("-")
    if not k.isdigit() or not (method in ("ngram", "suffix", "self", "eagle3", "mtp")
                               or method.startswith("head") and method[4:].isdigit()):
        raise SystemExit(f"unknown config {name!r}: off, ngram-K, suffix-K, self-K, headL-K, eagle3-K, mtp-K "
                         f"or llama.cpp-{{off,ngram-K,self-K,headL-K}}")
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": lookup[0],
                "prompt_lookup_max": lookup[1]}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": int(k)}
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": int(k)}
    if method == "eagle3":
        head = None if model is None else eagle3_checkpoint(model)
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": int(k)}
    draft = model
    if model is not None and method != "self":
        draft = head_checkpoint(model, int(method[4:]))
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": int(k)}


def _counters(llm: Any) -> tuple[int, int, int, list[int]]:
    s = llm.stats()
    return s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens, list(s.spec_accepted_per_pos)


def _timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def _itl(llm: Any, groups: list[list[list[int]]], tokens: int) -> float:
    """ms per decode step of each group of prompts run together, median over the groups."""
    from noria import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + tokens, temperature=0.0, ignore_eos=True)
    steps = []
    for prompts in groups:
        t1, _ = _timed(llm, prompts, one)
        tn, _ = _timed(llm, prompts, many)
        steps.append((tn - t1) / tokens * 1000)
    return statistics.median(steps)


def _work(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    return [(p, min(m, args.max_tokens or m)) for p, m in w1(num_requests=args.num_requests)]


def run_config(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from noria import LLM, SamplingParams

    if spec_llama_cpp.is_llama_cpp(name):
        return spec_llama_cpp.run_config(name, model, args, _work(args))
    work = _work(args)
    prompts = [p for p, _ in work]
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    sampled = [SamplingParams(max_tokens=m, temperature=1.0, seed=i, ignore_eos=True)
               for i, (_, m) in enumerate(work)]
    spec = _config(name, args.lookup, model)
    if spec is not None and spec["method"] == "mtp":  # the same network, with an MTP layer beside it
        model = mimo_checkpoint(model)
    row: dict[str, Any] = {"config": name}
    with LLM(str(model), dtype=args.dtype, speculative_config=spec, num_kv_blocks=args.num_kv_blocks) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
        parts = {
            "itl_b1": lambda: _itl(llm, [[p] for p in prompts[:args.b1_prompts]], args.tokens),
            "itl_b8": lambda: _itl(llm, [prompts[:8]], args.tokens),
            "b32": lambda: _rate(llm, prompts[:32], SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                                  ignore_eos=True)),
            "w1": lambda: _rate(llm, prompts, greedy),
            "w1_sampled": lambda: _rate(llm, prompts, sampled),
        }
        for part, measure in parts.items():
            before = _counters(llm)
            row[part] = measure()
            after = _counters(llm)
            drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3], strict=True))
            per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
            row[f"{part}_acceptance"] = {
                "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
                "mean_accepted": accepted / drafts if drafts else 0.0,
                "accepted_rate": round(accepted / draft_tokens, 3) if draft_tokens else 0.0,
                "rate_per_pos": [round(c / drafts, 3) for c in per_pos] if drafts else [],
            }
    return row


def _rate(llm: Any, prompts: list[list[int]], params: Any) -> float:
    seconds, tokens = _timed(llm, prompts, params)
    return tokens / seconds


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ratio(value: float | None, base: float | None, width: int, lower_is_better: bool = False) -> str:
    if value is None or base is None:
        return f"{'-':>{width}}"
    return f"{(base / value if lower_is_better else value / base):>{width - 1}.2f}x"


def _print(rows: list[dict[str, Any]]) -> None:
    """The table: each config against its own system's `off` (noria's off, or llama.cpp-off)."""
    offs = {"noria": None, "llama.cpp": None}
    for r in rows:
        if r["config"] in ("off", "llama.cpp-off", "llama.cpp"):
            offs["llama.cpp" if spec_llama_cpp.is_llama_cpp(r["config"]) else "noria"] = r
    print(f"\n{'config':<18} {'ITL b1 ms':>10} {'ITL b8 ms':>10} {'b32 tok/s':>10} {'W1 tok/s':>10} "
          f"{'W1 sampled':>11}  accepted share of drafted tokens (b1 / W1)")
    for r in rows:
        acc = " / ".join(f"{r[f'{p}_acceptance']['accepted_rate']:.2f}" for p in ("itl_b1", "w1"))
        print(f"{r['config']:<18} {_fmt(r['itl_b1'], 10, 2)} {_fmt(r['itl_b8'], 10, 2)} {_fmt(r['b32'], 10)} "
              f"{_fmt(r['w1'], 10)} {_fmt(r['w1_sampled'], 11)}  {acc}")
        base = offs["llama.cpp" if spec_llama_cpp.is_llama_cpp(r["config"]) else "noria"]
        if base is not None and r is not base:
            print(f"{'  vs its off':<18} {_ratio(r['itl_b1'], base['itl_b1'], 10, True)} "
                  f"{_ratio(r['itl_b8'], base['itl_b8'], 10, True)} {_ratio(r['b32'], base['b32'], 10)} "
                  f"{_ratio(r['w1'], base['w1'], 10)} {_ratio(r['w1_sampled'], base['w1_sampled'], 11)}")


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["config"] for r in rows]
    axes[0].bar(names, [r["itl_b1"] for r in rows], label="batch 1")
    axes[0].bar(names, [r["itl_b8"] for r in rows], alpha=0.5, label="batch 8")
    axes[0].set_ylabel("ms per decode step")
    axes[0].legend()
    for i, part in enumerate(("b32", "w1", "w1_sampled")):
        axes[1].bar([j + i * 0.25 for j in range(len(rows))], [r[part] or 0.0 for r in rows], 0.25, label=part)
    axes[1].set_xticks([j + 0.25 for j in range(len(rows))], names)
    axes[1].set_ylabel("output tok/s")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="off,ngram-2,ngram-4",
                    help="comma-separated: off, ngram-K, suffix-K, self-K (the target as its own draft), headL-K "
                         "(a draft of the target's first L layers), eagle3-K (a random head), mtp-K (the target as a MiMo "
                         "checkpoint, its random MTP layer drafting), and llama.cpp's own: "
                         "llama.cpp-off, llama.cpp-ngram-K, llama.cpp-self-K, llama.cpp-headL-K")
    ap.add_argument("--inert-after", type=int, default=None, metavar="L",
                    help="the target with its layers from L on adding nothing (bench/spec_models.py), so that "
                         "headL-K drafts it with every proposal right")
    ap.add_argument("--rounds", type=int, default=2, help="each configuration this many times, interleaved")
    ap.add_argument("--lookup", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 3),
                    help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--model", choices=sorted(CHECKPOINTS), default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens of the ITL and b32 rows")
    ap.add_argument("--b1-prompts", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=128, help="W1's requests")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap W1's output lengths (a short run)")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", default="bench/results/spec")
    args = ap.parse_args(argv)
    model = CHECKPOINTS[args.model]()
    if args.inert_after is not None:
        model = inert_checkpoint(model, args.inert_after)
    names = args.configs.split(",")
    for name in names:
        _config(name, args.lookup)
    names = _buildable(names)
    rows = []
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            print(f"round {round_ + 1}: {name} ...", flush=True)
            rows.append(run_config(name, model, args))
            print(json.dumps(rows[-1]), flush=True)
    best = [_best([r for r in rows if r["config"] == n]) for n in names]
    _print(best)
    save_rows(args.out, "spec", args, rows, plot)
    return 0


def _buildable(names: list[str]) -> list[str]:
    """`names` less the llama.cpp configs where llama.cpp cannot be built (said in one line)."""
    wanted = [n for n in names if spec_llama_cpp.is_llama_cpp(n)]
    if not wanted:
        return names
    from noria.bench.llama_cpp import setup

    why = setup()
    if why is None:
        return names
    print(f"skipping {', '.join(wanted)}: {why}", flush=True)
    return [n for n in names if n not in wanted]


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's best round: the lowest ITLs and the highest rates, each on its own."""
    best = dict(runs[0])
    for r in runs[1:]:
        for key, pick in (("itl_b1", min), ("itl_b8", min), ("b32", max), ("w1", max), ("w1_sampled", max)):
            if r[key] is not None:
                best[key] = r[key] if best[key] is None else pick(best[key], r[key])
    return best


if __name__ == "__main__":
    raise SystemExit(main())
