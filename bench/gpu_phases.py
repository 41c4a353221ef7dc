"""`noria bench gpu`'s measuring phases: noria's engine (inter-token latency with CUDA graphs and
eager, offline throughput, TTFT, speculative decoding) and the anchor, transformers' static-cache
`generate`; the quantized kinds beside them are bench/gpu_quant.py's."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from noria.bench.gpu_budget import Budget, PhaseTimeout, Sizes
from noria.bench.gpu_probes import sync
from noria.bench.gpu_report import Report, Row
from noria.bench.gpu_roofline import ModelCost, itl_floor, prefill_floor, throughput_ceiling
from noria.protocol.model_spec import ModelSpec


def _prompt_vocab(spec: ModelSpec) -> int:
    # Prompt ids below 32000 are real tokens of any tokenizer a --model checkpoint may bring
    # (its config's vocab_size can exceed its tokenizer's).
    return min(spec.vocab_size, 32000)


def _prompts(rng: Any, n: int, length: int, vocab: int) -> list[list[int]]:
    # Distinct random ids: no prefix-cache hit between requests.
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def _noria_run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from noria import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def _itl(run: Any, rng: Any, batch: int, sizes: Sizes, vocab: int) -> float:
    """Seconds per decode step at `batch`: a run of 1 + N tokens minus a run of 1 (the prefill
    and the first token), over N, each on fresh prompts."""
    one, _ = run(_prompts(rng, batch, sizes.itl_prompt, vocab), 1)
    many, _ = run(_prompts(rng, batch, sizes.itl_prompt, vocab), 1 + sizes.itl_tokens)
    return max(many - one, 1e-9) / sizes.itl_tokens


def engine_flags(args: argparse.Namespace, sizes: Sizes, spec: ModelSpec, load_format: str) -> dict[str, Any]:
    flags: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "seed": args.seed, "load_format": load_format,
                             "max_model_len": min(sizes.max_model_len, spec.max_position_embeddings)}
    if args.tiny:
        flags["num_kv_blocks"] = 256
    return flags


def decode_flags(flags: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """An engine for the decode rows only: graphs of exactly the batches measured, so that a start
    captures a few graphs, not one per multiple of 8 up to 256."""
    batches = sorted({*sizes.itl_batches, *sizes.quant_batches})
    return flags | {"max_num_seqs": batches[-1], "cuda_graph_sizes": batches}


def graphs_mode(args: argparse.Namespace) -> str:
    from noria.protocol.config import EngineConfig

    has_eager = "enforce_eager" in EngineConfig.__struct_fields__
    return "CUDA graphs" if args.device == "cuda" and has_eager else "default"


def itl_phase(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
              spec: ModelSpec, gbps: float, flags: dict[str, Any], after: Any = None) -> None:
    """Inter-token latency at each batch on an engine of the model's dtype; `after(llm, itl_by_batch)`
    adds what else that engine measures (the quantized comparison's baseline rows)."""
    import numpy as np

    from noria import LLM
    from noria.protocol.config import EngineConfig

    has_eager = "enforce_eager" in EngineConfig.__struct_fields__
    rep.meta["graphs"] = "compared (--enforce-eager)" if has_eager else "n/a (the engine has no enforce_eager)"
    vocab, rng, mode = _prompt_vocab(spec), np.random.default_rng(args.seed), graphs_mode(args)
    itl_ctx = sizes.itl_prompt + sizes.itl_tokens // 2
    with b.phase("itl") as go:
        if not go:
            return
        llm = None
        try:
            start = time.perf_counter()
            llm = LLM(model, **decode_flags(flags, sizes))
            rep.add(Row("itl", "engine start (load + graph capture)", time.perf_counter() - start, "s"))
            _noria_run(llm, _prompts(rng, 2, 16, vocab), 2)  # warm-up
            itl: dict[int, float] = {}
            for batch in sizes.itl_batches:
                itl[batch] = _itl(lambda ps, n: _noria_run(llm, ps, n), rng, batch, sizes, vocab)
                rep.add(Row("itl", f"ITL batch {batch} ({mode})", itl[batch] * 1e3, "ms",
                            itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))
            if after is not None:
                after(llm, itl)
        finally:
            if llm is not None:
                llm.shutdown()


def throughput_phases(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
                      spec: ModelSpec, gbps: float, tflops: float | None, flags: dict[str, Any]) -> None:
    """Offline throughput and TTFT on one engine of the model's dtype with the default graphs."""
    import numpy as np

    from noria import LLM

    vocab, rng = _prompt_vocab(spec), np.random.default_rng(args.seed + 2)
    max_len = flags["max_model_len"]
    llm: Any = None
    try:
        with b.phase("throughput") as go:
            if go:
                start = time.perf_counter()
                llm = LLM(model, **flags)
                rep.add(Row("throughput", "engine start (load + graph capture)", time.perf_counter() - start, "s"))
                _noria_run(llm, _prompts(rng, 2, 16, vocab), 2)  # warm-up
                seconds, tokens = _noria_run(llm, _prompts(rng, sizes.requests, sizes.prompt, vocab), sizes.output)
                max_batch = min(sizes.requests, llm.config.max_num_seqs)
                ceiling = throughput_ceiling(cost, sizes.requests, sizes.prompt, sizes.output, max_batch, gbps, tflops)
                rep.add(Row("throughput", f"offline {sizes.requests} x {sizes.prompt}/{sizes.output}",
                            tokens / seconds, "tok/s", ceiling, f"{tokens} tokens in {seconds:.1f} s"))
        with b.phase("ttft") as go:
            if go:
                llm = llm or LLM(model, **flags)
                for p in sizes.ttft_prompts:
                    if p >= max_len:
                        rep.add(Row("ttft", f"TTFT {p}-token prompt", None, "ms", None,
                                    f"over the model's {max_len} positions"))
                        continue
                    seconds, _ = _noria_run(llm, _prompts(rng, 1, p, vocab), 1)
                    floor, bound = prefill_floor(cost, p, gbps, tflops)
                    rep.add(Row("ttft", f"TTFT {p}-token prompt", seconds * 1e3, "ms", floor * 1e3,
                                f"{bound}-bound floor"))
    finally:
        if llm is not None:
            llm.shutdown()


def eager_phase(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
                spec: ModelSpec, gbps: float, flags: dict[str, Any]) -> None:
    import numpy as np

    from noria import LLM
    from noria.protocol.config import EngineConfig

    vocab, rng = _prompt_vocab(spec), np.random.default_rng(args.seed + 3)
    itl_ctx = sizes.itl_prompt + sizes.itl_tokens // 2
    with b.phase("eager") as go:
        if not go:
            return
        if "enforce_eager" not in EngineConfig.__struct_fields__:
            rep.add(Row("eager", "graphs vs eager", None, "", None, "this engine has no enforce_eager flag"))
            return
        llm = None
        try:
            start = time.perf_counter()
            llm = LLM(model, **decode_flags(flags, sizes), enforce_eager=True)
            rep.add(Row("eager", "engine start (eager)", time.perf_counter() - start, "s"))
            for batch in sizes.itl_batches:
                s = _itl(lambda ps, n: _noria_run(llm, ps, n), rng, batch, sizes, vocab)
                rep.add(Row("eager", f"ITL batch {batch} (eager)", s * 1e3, "ms",
                            itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))
        finally:
            if llm is not None:
                llm.shutdown()


def hf_phase(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
             spec: ModelSpec, gbps: float, dev: Any) -> None:
    with b.phase("hf") as go:
        if not go:
            return
        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        dtype = getattr(torch, args.dtype)
        if any(Path(model).glob("*.safetensors")):
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                      device_map=dev.type if dev.type == "cuda" else None).eval()
        else:  # a config-only folder (noria's dummy weights): transformers' own random init, on the device
            from transformers import AutoConfig

            with torch.device(dev):
                hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=dtype).eval()
        rng = np.random.default_rng(args.seed + 1)
        itl_ctx = sizes.itl_prompt + sizes.itl_tokens // 2

        def run(compiled: bool) -> Any:
            def go_(prompts: list[list[int]], n: int) -> tuple[float, int]:
                ids = torch.tensor(prompts, device=dev)
                sync(dev)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, eos_token_id=None,
                                      cache_implementation="static", disable_compile=not compiled)
                sync(dev)
                return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * ids.shape[0]
            return go_

        # Eager first: a compile that fails or eats the budget still leaves these figures.
        for compiled in (False, True):
            if compiled and dev.type != "cuda":
                rep.add(Row("hf", "static cache + torch.compile", None, "", None, "measured on a GPU only"))
                break
            label = "static cache + torch.compile" if compiled else "static cache, eager"
            for batch in sizes.hf_batches:
                try:
                    fn = run(compiled)
                    fn(_prompts(rng, batch, sizes.itl_prompt, _prompt_vocab(spec)), 2)  # warm-up (the compile)
                    s = _itl(fn, rng, batch, sizes, _prompt_vocab(spec))
                except PhaseTimeout:
                    raise
                except Exception as e:  # noqa: BLE001 - compile failures come in many kinds
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    rep.add(Row("hf", f"ITL batch {batch} (transformers, {label})", None, "ms", None, f"failed: {first[:160]}"))
                    continue
                rep.add(Row("hf", f"ITL batch {batch} (transformers, {label})", s * 1e3, "ms",
                            itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))


# Speculative decoding's GPU rows (the CPU's are `noria bench spec`): the proposers that need no
# second checkpoint. A dummy-weights model's greedy outputs repeat a token or a few, as the
# CPU benchmark's random models do, so the drafts are mostly right: the rows measure what
# verification costs and buys on the device, not a trained model's acceptance.
SPEC_CONFIGS = {"ngram-4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 4},
                "suffix-4": {"method": "suffix", "num_speculative_tokens": 4}}


def spec_phase(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, spec: ModelSpec,
               flags: dict[str, Any], off: dict[int, float]) -> None:
    """ITL at each of `sizes.spec_batches` with each proposer, beside the itl phase's (`off`)."""
    import numpy as np

    from noria import LLM

    vocab, rng = _prompt_vocab(spec), np.random.default_rng(args.seed + 3)
    with b.phase("spec") as go:
        if not go:
            return
        for name, config in SPEC_CONFIGS.items():
            llm = LLM(model, **decode_flags(flags, sizes), speculative_config=config)
            try:
                _noria_run(llm, _prompts(rng, 2, 16, vocab), 2)  # warm-up
                for batch in sizes.spec_batches:
                    before = llm.stats()
                    itl = _itl(lambda ps, n, llm=llm: _noria_run(llm, ps, n), rng, batch, sizes, vocab)
                    after = llm.stats()
                    drafts = after.spec_drafts - before.spec_drafts
                    kept = (after.spec_accepted_tokens - before.spec_accepted_tokens) / drafts if drafts else 0.0
                    ratio = f"{off[batch] / itl:.2f}x the speed of off" if off.get(batch) else "off not measured"
                    rep.add(Row("spec", f"ITL batch {batch} ({name})", itl * 1e3, "ms", None,
                                f"{ratio}; {drafts} drafts, {kept:.2f} tokens kept per draft"))
            finally:
                llm.shutdown()
