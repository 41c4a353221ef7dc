"""Tiny quantized mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) and their references.

transformers 5 holds a model's experts fused ([E, 2I, H] parameters, no nn.Linear per expert), so
compressed-tensors, which quantizes Linear modules, cannot be applied to the model itself. The
checkpoint is quantized as the quantizers see it instead: every linear weight of the float
checkpoint (as save_pretrained writes it, one module per expert) becomes an nn.Linear of the same
name in a stand-in module tree, and compressed-tensors' own lifecycle (bench/quantized_models.py:
apply the config, scales from each weight's range, its compressor) quantizes and compresses that
tree; its state dict and the untouched tensors are the checkpoint. The router (`gate`) and
Qwen2-MoE's `shared_expert_gate` are ignored, as llm-compressor's MoE recipes ignore them.

The references are float checkpoints of the same weights dequantized: compressed-tensors'
decompressor on the compressed tree (its own reading of what it wrote), the hand-written AWQ/GPTQ
dequantizer of tests/awq_gptq_files.py, or q * scale for FP8 blocks; transformers loads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests import awq_gptq_files as hand
from tests.tiny_models import make_checkpoint

# Groups of 32 divide every layer: hidden 128, each expert's 64 columns (32 per rank under two
# ranks), the shared expert's and Qwen3-MoE's dense first layer's 128.
SIZES: dict[str, dict[str, Any]] = {
    "mixtral": {"hidden_size": 128, "intermediate_size": 64},
    "qwen2_moe": {"hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    "qwen3_moe": {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 128},
}
# 128 x 128 FP8 blocks: every input width a multiple of 128.
BLOCK_SIZES = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 256}
ROUTERS = ("re:.*\\.gate$", "re:.*shared_expert_gate$", "lm_head")


def _linear_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint's linear modules: every 2-D weight but the embedding."""
    return [n.removesuffix(".weight") for n, t in tensors.items()
            if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n]


def _stand_in(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree with an nn.Linear, named as in the checkpoint, per linear weight."""
    root = nn.Module()
    for name in _linear_names(tensors):
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        w = tensors[name + ".weight"]
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        parent.add_module(leaf, linear)
    return root


def float_checkpoint(arch: str, path: Path, **overrides: Any) -> Path:
    return make_checkpoint(arch, path, **{**SIZES[arch], **overrides})


def save_compressed(arch: str, path: Path, scheme: str, ignore: tuple[str, ...] = ROUTERS,
                    **overrides: Any) -> tuple[Path, Path]:
    """(a compressed-tensors checkpoint of a tiny `arch` by `scheme` (bench/quantized_models.py's
    names), the float checkpoint compressed-tensors' decompressor reads back from it)."""
    from noria.bench.quantized_models import quantize_model

    base = float_checkpoint(arch, path.with_name(path.name + "-float"), **overrides)
    tensors = load_file(str(base / "model.safetensors"))
    tree = _stand_in(tensors)
    compressor = quantize_model(tree, scheme, ignore)
    kept = {n: t for n, t in tensors.items() if n.removesuffix(".weight") not in _linear_names(tensors)}
    _write(base, path, {**kept, **{n: t.contiguous() for n, t in tree.state_dict().items()}})
    compressor.update_config(str(path))
    compressor.decompress_model(tree)
    plain = {n: t.float() for n, t in tree.state_dict().items() if n.endswith(".weight")}
    return path, _write(base, path.with_name(path.name + "-dequantized"), {**kept, **plain})


def _write(base: Path, path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    shutil.copy(base / "config.json", path / "config.json")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _quantized(name: str) -> bool:
    """The modules AWQ, GPTQ and FP8 checkpoints quantize: every linear one but routers and the lm_head."""
    return not (name.endswith((".gate", "shared_expert_gate")) or name == "lm_head")


def save_awq_gptq(arch: str, path: Path, variant: hand.Variant, **overrides: Any) -> tuple[Path, Path]:
    """(a checkpoint packed in `variant`'s layout (tests/awq_gptq_files.py's packers; each
    expert's gate and up share one activation order, as they share an input), the float
    checkpoint of the weights the documented dequantizer reads back from it)."""
    base = float_checkpoint(arch, path.with_name(path.name + "-float"), **overrides)
    tensors = load_file(str(base / "model.safetensors"))
    packed, plain = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(5)
    orders: dict[str, torch.Tensor] = {}
    for name in filter(_quantized, _linear_names(tensors)):
        w = packed.pop(name + ".weight")
        k = w.shape[1]
        group = k if variant.group == -1 else variant.group
        g_idx = (torch.arange(k) // group).int()
        if variant.desc_act:  # one order per input: q/k/v share theirs, gate/up (or w1/w3) theirs
            key = name.rsplit(".", 1)[0] + ("" if name.endswith(("o_proj", "down_proj", "w2")) else "+in")
            if key not in orders:
                orders[key] = g_idx[torch.randperm(k, generator=gen)].clone()
            g_idx = orders[key]
        q, scale, zero = hand.quantize(w, variant.bits, group, variant.sym and variant.method == "gptq", g_idx)
        if variant.method == "awq":
            files = {"qweight": hand.pack_awq(q), "qzeros": hand.pack_awq(zero), "scales": scale}
        else:
            stored = (zero - 1 if variant.fmt == "gptq" else zero) & ((1 << variant.bits) - 1)
            files = {"qweight": hand.pack_rows(q, variant.bits), "qzeros": hand.pack_columns(stored, variant.bits),
                     "scales": scale, "g_idx": g_idx.clone()}
        packed |= {f"{name}.{key}": value for key, value in files.items()}
        plain[name + ".weight"] = hand.dequantize(files, variant).float()
    out = _write(base, path, packed)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = variant.config()
    (out / "config.json").write_text(json.dumps(cfg))
    return out, _write(base, path.with_name(path.name + "-dequantized"), plain)


def save_fp8_blocks(arch: str, path: Path, **overrides: Any) -> tuple[Path, Path]:
    """(a quant_method fp8 checkpoint with 128 x 128 blocks, as FP8 Qwen3-30B-A3B ships: every
    quantized module's e4m3 `weight` and float32 `weight_scale_inv` per block, max |w| / 448;
    the float checkpoint of q * scale)."""
    from tests.fp8_checkpoints import block_quantize

    base = make_checkpoint(arch, path.with_name(path.name + "-float"), **{**BLOCK_SIZES, **overrides})
    tensors = load_file(str(base / "model.safetensors"))
    packed, plain = dict(tensors), dict(tensors)
    for name in filter(_quantized, _linear_names(tensors)):
        q, scale = block_quantize(tensors[name + ".weight"])
        packed[name + ".weight"], packed[name + ".weight_scale_inv"] = q, scale
        n, k = q.shape
        plain[name + ".weight"] = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    out = _write(base, path, packed)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, _write(base, path.with_name(path.name + "-dequantized"), plain)


def reference_logits(path: Path, prompt: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """transformers' logits of a float checkpoint (a dequantized one above), every position."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, experts_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]
