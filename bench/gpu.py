"""`noria bench gpu`: the engine on one GPU, against its HBM roofline and transformers, in under 8 minutes.

Builds (once, into the cache folder) a bfloat16 Llama-3-8B-shaped checkpoint with seeded random
weights and a word-level tokenizer of the same vocabulary, or takes `--model PATH`; then measures
offline throughput (256 requests x 1024 prompt / 256 output tokens, EOS ignored), TTFT of one 2k
and one 8k prompt, inter-token latency at batch 1 and 32 with CUDA graphs and, where the engine
has `enforce_eager`, without; and the anchor: Hugging Face transformers `generate` with a static
cache on the same checkpoint and GPU, at batch 1 and 16, eager and (where it works) compiled.

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
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_VERSION = 1

# Llama 3 8B's shapes (the weights are random): what a GPU benchmark of an 8B model reads per step.
LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 16384,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
}
TINY: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}
PHASES = ("probe", "checkpoint", "throughput", "ttft", "itl", "eager", "hf")


@dataclass(frozen=True)
class Sizes:
    requests: int = 256
    prompt: int = 1024
    output: int = 256
    ttft_prompts: tuple[int, ...] = (2048, 8192)
    itl_batches: tuple[int, ...] = (1, 16, 32)  # 16: the anchor's larger batch
    itl_prompt: int = 512
    itl_tokens: int = 128
    hf_batches: tuple[int, ...] = (1, 16)
    max_model_len: int = 8192 + 256
    # Seconds a phase needs at least (skipped when less is left) and may take at most.
    need: dict[str, float] = field(default_factory=lambda: {
        "probe": 5, "checkpoint": 60, "throughput": 90, "ttft": 10, "itl": 20, "eager": 60, "hf": 60})
    cap: dict[str, float] = field(default_factory=lambda: {
        "probe": 30, "checkpoint": 150, "throughput": 200, "ttft": 60, "itl": 90, "eager": 120, "hf": 150})


TINY_SIZES = Sizes(requests=6, prompt=24, output=6, ttft_prompts=(32, 96), itl_batches=(1, 2, 3), itl_prompt=16,
                   itl_tokens=6, hf_batches=(1, 2), max_model_len=256,
                   need=dict.fromkeys(PHASES, 0.0), cap=dict.fromkeys(PHASES, 120.0))


# ---------------------------------------------------------------- roofline arithmetic (pure)

@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every parameter, read once per forward pass
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: int  # 2 x the parameters a token multiplies through (the embedding is a lookup)
    attn_flops_per_pair: int  # QK^T and PV for one (query, key) pair over all layers


def model_cost(cfg: dict[str, Any], dtype_bytes: int = 2) -> ModelCost:
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter
    matmul_params = layers * per_layer + vocab * h  # lm_head
    params = matmul_params + (0 if cfg.get("tie_word_embeddings") else vocab * h) + (2 * layers + 1) * h
    return ModelCost(
        weight_bytes=params * dtype_bytes,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
        flops_per_token=2 * matmul_params,
        attn_flops_per_pair=4 * layers * heads * head_dim,
    )


def decode_step_floor(cost: ModelCost, contexts: Sequence[int], gbps: float) -> float:
    """Seconds a decode step over sequences of these context lengths must take at `gbps`:
    the weights once plus every sequence's K/V."""
    return (cost.weight_bytes + sum(contexts) * cost.kv_bytes_per_token) / (gbps * 1e9)


def prefill_floor(cost: ModelCost, prompt: int, gbps: float, tflops: float | None) -> tuple[float, str]:
    """(seconds, "memory" or "compute") for one prompt's prefill: the weights read and its K/V
    written, or its matmul FLOPs (causal attention counted) at `tflops`, whichever is slower."""
    memory = (cost.weight_bytes + prompt * cost.kv_bytes_per_token) / (gbps * 1e9)
    if not tflops:
        return memory, "memory"
    flops = prompt * cost.flops_per_token + cost.attn_flops_per_pair * prompt * (prompt + 1) / 2
    compute = flops / (tflops * 1e12)
    return (compute, "compute") if compute > memory else (memory, "memory")


def throughput_ceiling(cost: ModelCost, requests: int, prompt: int, output: int, max_batch: int, gbps: float,
                       tflops: float | None) -> float:
    """Output tokens/s no engine can beat on this workload: the requests in waves of `max_batch`,
    each wave's prefills at their floor, then `output` decode steps (the first token comes from
    the prefill) over contexts that grow by one a step."""
    total, left = 0.0, requests
    while left > 0:
        b = min(left, max_batch)
        total += b * prefill_floor(cost, prompt, gbps, tflops)[0]
        total += sum(decode_step_floor(cost, [prompt + s] * b, gbps) for s in range(1, output))
        left -= b
    return requests * output / total


def itl_floor(cost: ModelCost, batch: int, context: int, gbps: float) -> float:
    return decode_step_floor(cost, [context] * batch, gbps)


# ---------------------------------------------------------------- the report, written as it goes

@dataclass
class Row:
    phase: str
    name: str
    value: float | None  # None: not measurable here (the note says why)
    unit: str
    floor: float | None = None  # the roofline in the same unit (a ceiling for rates)
    note: str = ""

    @property
    def of_roofline(self) -> float | None:
        """How close to the roofline: floor / measured for times, measured / ceiling for rates."""
        if not self.floor or not self.value:
            return None
        return self.value / self.floor if self.unit.endswith("/s") else self.floor / self.value


class Report:
    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.json_path, self.md_path = out.with_suffix(".json"), out.with_suffix(".md")
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.rows: list[Row] = []
        self.phases: dict[str, dict[str, Any]] = {}
        self.flush()

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        pct = f" ({row.of_roofline:.0%} of roofline)" if row.of_roofline is not None else ""
        print(f"  {row.name}: {_value(row)}{pct}{'; ' + row.note if row.note else ''}", flush=True)
        self.flush()
        return row

    def phase(self, name: str, status: str, seconds: float, note: str = "") -> None:
        self.phases[name] = {"status": status, "seconds": round(seconds, 2), "note": note}
        self.flush()

    def data(self) -> dict[str, Any]:
        return {"meta": self.meta, "phases": self.phases,
                "rows": [asdict(r) | {"of_roofline": r.of_roofline} for r in self.rows]}

    def flush(self) -> None:
        for path, text in ((self.json_path, json.dumps(self.data(), indent=2)), (self.md_path, self.markdown())):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)  # a reader (or a kill) never sees half a file

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# noria bench gpu: {m.get('device', '?')}", "",
                 f"Model: {m.get('model', '?')}; {m.get('dtype', '?')}. Device copy "
                 f"{_fmt(m.get('copy_gbps'))} GB/s (read + write), matmul {_fmt(m.get('matmul_tflops'))} TFLOP/s. "
                 f"Graphs: {m.get('graphs', '?')}.", "",
                 "| phase | measurement | value | roofline | % of roofline | note |",
                 "|---|---|---:|---:|---:|---|"]
        for r in self.rows:
            pct = f"{r.of_roofline:.0%}" if r.of_roofline is not None else ""
            floor = f"{_fmt(r.floor)} {r.unit}" if r.floor else ""
            lines.append(f"| {r.phase} | {r.name} | {_value(r)} | {floor} | {pct} | {r.note} |")
        lines += ["", "| phase | status | s | note |", "|---|---|---:|---|"]
        lines += [f"| {k} | {v['status']} | {v['seconds']} | {v['note']} |" for k, v in self.phases.items()]
        return "\n".join(lines)


def _value(r: Row) -> str:
    return "n/a" if r.value is None else f"{_fmt(r.value)} {r.unit}".strip()


def _fmt(x: Any) -> str:
    if not isinstance(x, int | float):
        return "?" if x is None else str(x)
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


# ---------------------------------------------------------------- phases under a time budget

class PhaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise PhaseTimeout


class Budget:
    def __init__(self, seconds: float, report: Report, sizes: Sizes, only: set[str]) -> None:
        self.deadline = time.monotonic() + seconds
        self.report, self.sizes, self.only = report, sizes, only
        self.ok: set[str] = set()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[bool]:
        """Yields whether to run `name`; records how it ended. SIGALRM cuts it at its cap or at
        the deadline, whichever comes first."""
        if name not in self.only:
            self.report.phase(name, "skipped", 0.0, "not asked for (--phases)")
            yield False
            return
        need, left = self.sizes.need[name], self.left()
        if left < max(need, 1.0):
            self.report.phase(name, "skipped", 0.0, f"time: needs ~{need:.0f} s, {max(left, 0):.0f} s left")
            print(f"[{name}] skipped: {max(left, 0):.0f} s of the budget left", flush=True)
            yield False
            return
        print(f"[{name}]", flush=True)
        start = time.monotonic()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, min(self.sizes.cap[name], left)))
        try:
            yield True
            self.ok.add(name)
            self.report.phase(name, "ok", time.monotonic() - start)
        except PhaseTimeout:
            self.report.phase(name, "cut short", time.monotonic() - start, "over its time budget")
            print(f"[{name}] cut short: over its time budget", flush=True)
        except Exception as e:  # noqa: BLE001 - one failed phase must not lose the others' figures
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.report.phase(name, "failed", time.monotonic() - start, f"{type(e).__name__}: {first}"[:300])
            print(f"[{name}] failed: {type(e).__name__}: {first}", flush=True)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- probes

def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def probe_copy_gbps(dev: Any, nbytes: int) -> float:
    """Device copy bandwidth counting bytes read and written (as `noria bench kernels` reports it)."""
    import torch

    if dev.type == "cuda":
        try:
            from noria.kernels.device_info import copy_gbps
        except ImportError:  # the kernels' CuPy side missing: the same copy, timed here
            pass
        else:
            return copy_gbps(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    start, n = time.perf_counter(), 5
    for _ in range(n):
        dst.copy_(src)
    _sync(dev)
    return 2 * nbytes * n / (time.perf_counter() - start) / 1e9


def probe_matmul_tflops(dev: Any, dtype: Any, n: int) -> float:
    import torch

    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    a @ b
    _sync(dev)
    start, iters = time.perf_counter(), 10
    for _ in range(iters):
        a @ b
    _sync(dev)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


# ---------------------------------------------------------------- the checkpoint

def build_checkpoint(out: Path, shape: dict[str, Any], dtype: str, dev: Any, seed: int = 0) -> Path:
    """A Llama checkpoint folder with seeded random weights and a word-level tokenizer covering
    the whole vocabulary, built beside `out` and renamed into place. Weights are drawn on `dev`
    a layer at a time and written in shards of a few layers, so an 8B model never sits whole in
    host memory."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if (out / "complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + "-build-", dir=out.parent))
    try:
        cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype=dtype)
        cfg.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        _write_tokenizer(tmp, shape["vocab_size"])
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(device=dev)
        h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
        heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
        hd = h // heads

        def w(*s: int) -> torch.Tensor:
            return (torch.randn(*s, generator=gen, device=dev) * 0.02).to(tdtype).cpu()

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=tdtype)

        weight_map: dict[str, str] = {}
        per_shard, layers = 4, shape["num_hidden_layers"]
        num_shards = 2 + -(-layers // per_shard)
        total = 0

        def write(shard: dict[str, torch.Tensor]) -> None:
            nonlocal total
            name = f"model-{len(set(weight_map.values())) + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update(dict.fromkeys(shard, name))

        gen.manual_seed(seed)
        write({"model.embed_tokens.weight": w(v, h), "model.norm.weight": ones(h)})
        write({"lm_head.weight": w(v, h)})
        for first in range(0, layers, per_shard):
            shard: dict[str, torch.Tensor] = {}
            for i in range(first, min(first + per_shard, layers)):
                gen.manual_seed(seed + 1 + i)  # each layer reproducible by itself
                p = f"model.layers.{i}."
                shard |= {
                    p + "self_attn.q_proj.weight": w(heads * hd, h), p + "self_attn.k_proj.weight": w(kvh * hd, h),
                    p + "self_attn.v_proj.weight": w(kvh * hd, h), p + "self_attn.o_proj.weight": w(h, heads * hd),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter),
                    p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                }
            write(shard)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "complete").write_text("ok\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # One word per id: every id the random model samples detokenizes, and no tokenizer training.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.save_pretrained(str(out))


# ---------------------------------------------------------------- measurements

def _prompt_vocab(shape: dict[str, Any]) -> int:
    # Prompt ids below 32000 are real tokens of any tokenizer a --model checkpoint may bring
    # (its config's vocab_size can exceed its tokenizer's).
    return min(shape["vocab_size"], 32000)


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


def noria_phases(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
                 shape: dict[str, Any], gbps: float, tflops: float | None) -> None:
    import numpy as np

    from noria import LLM
    from noria.protocol.config import EngineConfig

    vocab = _prompt_vocab(shape)
    has_eager = "enforce_eager" in EngineConfig.__struct_fields__
    rep.meta["graphs"] = "compared (--enforce-eager)" if has_eager else "n/a (the engine has no enforce_eager)"
    max_len = min(sizes.max_model_len, shape.get("max_position_embeddings") or sizes.max_model_len)
    flags: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "max_model_len": max_len, "seed": args.seed}
    if args.tiny:
        flags["num_kv_blocks"] = 256
    rng = np.random.default_rng(args.seed)
    itl_ctx = sizes.itl_prompt + sizes.itl_tokens // 2
    mode = "CUDA graphs" if args.device == "cuda" and has_eager else "default"
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
        with b.phase("itl") as go:
            if go:
                llm = llm or LLM(model, **flags)
                for batch in sizes.itl_batches:
                    s = _itl(lambda ps, n: _noria_run(llm, ps, n), rng, batch, sizes, vocab)
                    rep.add(Row("itl", f"ITL batch {batch} ({mode})", s * 1e3, "ms",
                                itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))
    finally:
        if llm is not None:
            llm.shutdown()
    llm = None
    with b.phase("eager") as go:
        if go:
            if not has_eager:
                rep.add(Row("eager", "graphs vs eager", None, "", None, "this engine has no enforce_eager flag"))
            else:
                try:
                    start = time.perf_counter()
                    llm = LLM(model, **flags, enforce_eager=True)
                    rep.add(Row("eager", "engine start (eager)", time.perf_counter() - start, "s"))
                    for batch in sizes.itl_batches:
                        s = _itl(lambda ps, n: _noria_run(llm, ps, n), rng, batch, sizes, vocab)
                        rep.add(Row("eager", f"ITL batch {batch} (eager)", s * 1e3, "ms",
                                    itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))
                finally:
                    if llm is not None:
                        llm.shutdown()


def hf_phase(b: Budget, rep: Report, args: argparse.Namespace, sizes: Sizes, model: str, cost: ModelCost,
             shape: dict[str, Any], gbps: float, dev: Any) -> None:
    with b.phase("hf") as go:
        if not go:
            return
        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype),
                                                  device_map=dev.type if dev.type == "cuda" else None).eval()
        rng = np.random.default_rng(args.seed + 1)
        itl_ctx = sizes.itl_prompt + sizes.itl_tokens // 2

        def run(compiled: bool) -> Any:
            def go_(prompts: list[list[int]], n: int) -> tuple[float, int]:
                ids = torch.tensor(prompts, device=dev)
                _sync(dev)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, eos_token_id=None,
                                      cache_implementation="static", disable_compile=not compiled)
                _sync(dev)
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
                    fn(_prompts(rng, batch, sizes.itl_prompt, _prompt_vocab(shape)), 2)  # warm-up (the compile)
                    s = _itl(fn, rng, batch, sizes, _prompt_vocab(shape))
                except PhaseTimeout:
                    raise
                except Exception as e:  # noqa: BLE001 - compile failures come in many kinds
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    rep.add(Row("hf", f"ITL batch {batch} (transformers, {label})", None, "ms", None, f"failed: {first[:160]}"))
                    continue
                rep.add(Row("hf", f"ITL batch {batch} (transformers, {label})", s * 1e3, "ms",
                            itl_floor(cost, batch, itl_ctx, gbps) * 1e3, f"context ~{itl_ctx}"))


def speedups(rows: Sequence[Row]) -> list[Row]:
    """noria's ITL against transformers' best at each batch both measured."""
    def by_batch(phase: str) -> dict[int, float]:
        best: dict[int, float] = {}
        for r in rows:
            if r.phase == phase and r.value and r.name.startswith("ITL batch "):
                b = int(r.name.split()[2])
                best[b] = min(best.get(b, r.value), r.value)
        return best

    ours, theirs = by_batch("itl"), by_batch("hf")
    return [Row("vs hf", f"ITL batch {b}: transformers / noria", theirs[b] / ours[b], "x", None,
                "above 1: noria is faster") for b in sorted(ours.keys() & theirs.keys())]


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local checkpoint folder; default: the random Llama-3-8B-"
                    "shaped one, built into the cache folder on first use (about 16 GB)")
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
            name = f"bench-gpu-{'tiny' if args.tiny else 'llama3-8b'}-{args.dtype}-v{CHECKPOINT_VERSION}-s{args.seed}"
            start = time.perf_counter()
            model = str(build_checkpoint(switches.cache_dir() / name, shape, args.dtype, dev, args.seed))
            rep.add(Row("checkpoint", "build (or find) the random checkpoint", time.perf_counter() - start, "s",
                        note=model))
    if model is None:
        print("noria bench gpu: no checkpoint (the build was skipped or failed); see", rep.md_path)
        return 0
    rep.meta["model"] = model
    shape = json.loads((Path(model) / "config.json").read_text())
    cost = model_cost(shape, torch.tensor([], dtype=getattr(torch, args.dtype)).element_size())
    rep.meta["weight_gb"] = cost.weight_bytes / 1e9
    rep.meta["kv_bytes_per_token"] = cost.kv_bytes_per_token
    rep.flush()

    noria_phases(budget, rep, args, sizes, model, cost, shape, gbps, tflops)
    hf_phase(budget, rep, args, sizes, model, cost, shape, gbps, dev)
    for r in speedups(rep.rows):
        rep.add(r)
    print(rep.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
