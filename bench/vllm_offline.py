"""One timed offline batch on vLLM's CPU backend, run by vLLM's own venv python.

Started by `noria.bench.vllm_cpu.run_offline`; imports only the standard library
and vllm (noria is not installed in vLLM's venv). The spec file holds
{"system": name, "work": [[prompt token ids, output length], ...]}; the row
written to --out has the seconds of `generate` alone (start-up compiles the
model for about a minute and is reported apart), the output token count and
every request's output token ids, for the greedy agreement check.
With --profile DIR the timed `generate` runs under vLLM's own torch profiler
(in its worker process, with its phase ranges "gpu_model_runner: forward",
"...: sample", ...); the worker's Chrome trace lands in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile", default=None, help="profile the timed generate; traces go to this folder")
    args = ap.parse_args()
    extra = {}
    if args.profile:
        # Phase ranges inside the model runner; read when vllm is imported.
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": os.path.abspath(args.profile),
                                    "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                                    "ignore_frontend": True}
    spec = json.loads(Path(args.spec).read_text())
    work = spec["work"]

    t_start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0, **extra)
    llm.generate([TokensPrompt(prompt_token_ids=work[0][0])],
                 SamplingParams(max_tokens=2, temperature=0.0, detokenize=False), use_tqdm=False)  # warm-up
    startup = time.perf_counter() - t_start
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for _, m in work]
    if args.profile:
        llm.start_profile()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    if args.profile:
        llm.stop_profile()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    settings = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_") or k == "LD_PRELOAD"}
    row = {"system": spec["system"], "seconds": dt, "output_tokens": sum(map(len, ids)),
           "startup_seconds": startup, "vllm_version": vllm.__version__, "settings": settings, "token_ids": ids}
    Path(args.out).write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
