"""`noria bench generate`: output tokens/s of LLM.generate on mixed max_tokens.

A first figure for later benchmarks: N requests (default 64) on the demo model,
prompts of 8-64 words, max_tokens drawn from (16, 32, 64, 128), greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import random
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench generate")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args, rest = ap.parse_known_args(argv)
    from noria import LLM, SamplingParams
    from noria.frontend.cli import add_engine_args, engine_flags

    eng = argparse.ArgumentParser()
    add_engine_args(eng)
    flags = engine_flags(eng.parse_args(rest))
    rng = random.Random(args.seed)
    words = ["the", "wheel", "turns", "and", "every", "bucket", "fills", "while", "the", "river", "runs"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 64))) for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=rng.choice((16, 32, 64, 128)), temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLM(args.model, **flags) as llm:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        stats = llm.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"requests        {len(prompts)}")
    print(f"output tokens   {n_out}")
    print(f"wall time       {dt:.2f} s")
    print(f"output tok/s    {n_out / dt:.1f}")
    print(f"engine steps    {stats.num_steps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
