"""The checkpoint `noria bench gpu` measures when no `--model` is given: a Llama with seeded random
weights at Llama-3-8B's shapes (or tiny ones), with a word-level tokenizer of the same vocabulary."""

from __future__ import annotations

import json
import os
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


def build_checkpoint(out: Path, shape: dict[str, Any], dtype: str, dev: Any, seed: int = 0,
                     weights: bool = True) -> Path:
    """A Llama checkpoint folder with seeded random weights and a word-level tokenizer covering
    the whole vocabulary, built beside `out` and renamed into place. Weights are drawn on `dev`
    a layer at a time and written in shards of a few layers, so an 8B model never sits whole in
    host memory. `weights` False: config.json and the tokenizer only, for `--load-format dummy`."""
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
        if not weights:
            (tmp / "complete").write_text("ok\n")
            _rename(tmp, out)
            return out
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
        _rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _rename(tmp: Path, out: Path) -> None:
    try:
        os.rename(tmp, out)
    except OSError:  # a concurrent builder got there first
        if not (out / "complete").exists():
            raise


# compressed-tensors' W4A16 (llm-compressor's preset): 4-bit symmetric integer weights in groups
# of 128, packed into int32 words (pack-quantized), float activations, the lm_head left in float.
W4A16_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 128, "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head"],
}


def quantized_variant(model: Path, out: Path, quantization_config: dict[str, Any]) -> Path:
    """`model`'s config.json with `quantization_config` and its tokenizer files in `out`, no
    weights: a quantized model of the same shape for `--load-format dummy`."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")) and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((model / "config.json").read_text())
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(cfg | {"quantization_config": quantization_config}, indent=1))
    os.replace(tmp, out / "config.json")
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
