"""Benchmark workloads and models, defined exactly so anyone can regenerate them."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

from noria.frontend.demo_model import cache_root, ensure_demo

SMALL = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "intermediate_size": 2048, "vocab_size": 32000, "max_position_embeddings": 2048,
}
OUTPUT_LENGTHS = (32, 40, 50, 64, 80, 96, 200, 512)
# For online runs with 4,000-token prompts: long positions, cheap enough to prefill on a CPU.
SERVING = {
    "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
    "intermediate_size": 1024, "vocab_size": 32000, "max_position_embeddings": 8192,
}

# A Qwen3-MoE as wide as "small" whose active MLP matches small's: 8 experts of 1024, top-2
# (2048 columns per token, small's intermediate_size), renormalised as Qwen3-30B-A3B is; every
# layer sparse. About 260M parameters, ~1 GiB in float32.
QWEN3_MOE_SMALL = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "intermediate_size": 2048, "moe_intermediate_size": 1024, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 32000, "max_position_embeddings": 2048,
}

# Llama-3.2-1B's and -3B's shapes (tied embeddings, a 128k vocabulary, llama3 rope left out:
# positions stay within the original 8k), saved in bfloat16 as those checkpoints ship.
LLAMA_1B = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
LLAMA_3B = {**LLAMA_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
            "head_dim": 128}


def w1(vocab_size: int = 32000, num_requests: int = 128) -> list[tuple[list[int], int]]:
    """Workload W1: (prompt token ids, output length) per request.

    `random.Random(0)`; per request, in this order: prompt length
    randint(32, 256), output length choice(OUTPUT_LENGTHS), then the prompt's
    token ids randrange(3, vocab_size) one by one.
    """
    rng = random.Random(0)
    out = []
    for _ in range(num_requests):
        n = rng.randint(32, 256)
        m = rng.choice(OUTPUT_LENGTHS)
        out.append(([rng.randrange(3, vocab_size) for _ in range(n)], m))
    return out


def small_checkpoint() -> Path:
    """The "small" Llama (~110M parameters): seeded random weights, float32,
    saved as a Hugging Face checkpoint (with the demo tokenizer for text)."""
    return _checkpoint("bench-small-v1", SMALL)


def serving_checkpoint() -> Path:
    """A ~30M-parameter Llama with 8,192 positions for the online benchmarks."""
    return _checkpoint("bench-serving-v1", SERVING)


def qwen3_moe_small_checkpoint() -> Path:
    """The "qwen3-moe-small" mixture of experts (QWEN3_MOE_SMALL), seeded like "small"."""
    return _checkpoint("bench-qwen3-moe-small-v1", QWEN3_MOE_SMALL, family="qwen3_moe")


def llama_1b_checkpoint() -> Path:
    """Llama-3.2-1B's shape (LLAMA_1B, ~1.24B parameters), seeded random weights, bfloat16."""
    return _checkpoint("bench-llama-1b-v1", LLAMA_1B, dtype="bfloat16")


def llama_3b_checkpoint() -> Path:
    """Llama-3.2-3B's shape (LLAMA_3B, ~3.2B parameters), seeded random weights, bfloat16."""
    return _checkpoint("bench-llama-3b-v1", LLAMA_3B, dtype="bfloat16")


def _checkpoint(name: str, shape: dict, family: str = "llama", dtype: str = "float32") -> Path:
    path = cache_root() / name
    if (path / "complete").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_cls(**{"tie_word_embeddings": False, **shape}, torch_dtype=dtype, bos_token_id=0, eos_token_id=1)
    model = model_cls(config).eval().to(getattr(torch, dtype))
    return write_checkpoint(path, lambda tmp: model.save_pretrained(tmp, safe_serialization=True), ensure_demo())


def write_checkpoint(path: Path, save: Callable[[Path], object], tokenizer: Path) -> Path:
    """A checkpoint folder written by `save` beside `path`, with `tokenizer`'s tokenizer files,
    marked complete and renamed into place: a reader never sees half of one."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, tmp / name)
    (tmp / "complete").write_text("ok\n")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _quantized(base: str, scheme: str) -> Callable[[], Path]:
    """`base` quantized by compressed-tensors (bench/quantized_models.py's `scheme`), made once."""
    def make() -> Path:
        from noria.bench.quantized_models import quantized_checkpoint

        return quantized_checkpoint(CHECKPOINTS[base](), scheme)
    return make


def _gguf(base: str, outtype: str) -> Callable[[], Path]:
    """`base` as a GGUF file of `outtype` ("q8_0", "q4_k_m") made by llama.cpp's own tools
    (bench/llama_cpp_build.py: its converter, then llama-quantize for a K-quant), made once; the
    file itself is the model (noria loads it through frontend/gguf_view.py, llama.cpp as it is)."""
    def make() -> Path:
        from noria.bench import llama_cpp_build

        checkpoint = CHECKPOINTS[base]()
        path = llama_cpp_build.gguf_path(checkpoint, outtype)
        if path.exists():
            return path
        why = llama_cpp_build.setup()
        if why:
            raise SystemExit(f"--model {base}-{outtype} is made by llama.cpp's own tools: {why}")
        return llama_cpp_build.convert(checkpoint, outtype)
    return make


# GGUF models ("small-q8_0", "small-q4_k_m", ...): the types llama.cpp's users run.
GGUF_TYPES = ("q8_0", "q4_k_m")
# The benchmark models by name, for `--model` flags.
CHECKPOINTS: dict[str, Callable[[], Path]] = {
    "small": small_checkpoint, "serving": serving_checkpoint, "qwen3-moe-small": qwen3_moe_small_checkpoint,
    "llama-1b": llama_1b_checkpoint, "llama-3b": llama_3b_checkpoint}
CHECKPOINTS.update({f"{base}-{scheme}": _quantized(base, scheme)
                    for base in ("small", "serving", "llama-1b") for scheme in ("w8a8", "w4a16", "fp8")})
CHECKPOINTS.update({f"{base}-{outtype}": _gguf(base, outtype)
                    for base in ("small", "serving", "llama-1b") for outtype in GGUF_TYPES})
