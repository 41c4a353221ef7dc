"""Tiny FP8 checkpoints for the tests.

compressed-tensors `float-quantized` ones are made by compressed-tensors itself, as
bench/quantized_models.py makes the int ones: its quantization config applied to a seeded
transformers model, the weight scales from each weight's range (its `calculate_qparams`), a
static scheme's `input_scale` from each layer's largest input over a calibration prompt (what
llm-compressor's min-max observer gives), then its compressor converts and saves.

`quant_method: fp8` block checkpoints (transformers' FineGrainedFP8 layout, as the FP8 Qwen3 and
DeepSeek checkpoints ship) are written here by hand: every linear weight but the lm_head as
e4m3 values with a float32 `weight_scale_inv` per 128 x 128 block, max |w| / 448 over the block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import make_model

FP8_MAX = 448.0
# hidden 256 and intermediate 384: two and three blocks of 128 input features; one kv head of
# 64 rows leaves k_proj and v_proj half a block of rows.
BLOCK_SIZES = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 1}
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
CALIBRATION = [1, 5, 9, 300, 42, 77, 128, 255, 3, 64, 400, 17]


def _input_amax(model: Any) -> dict[str, float]:
    """Each Linear's largest |input| over the calibration prompt."""
    seen: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(m: Any, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.tensor([CALIBRATION]))
    for h in hooks:
        h.remove()
    return seen


def save_compressed_fp8(path: Path, strategy: str, acts: str | None, arch: str = "llama",
                        ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """A compressed-tensors float-quantized checkpoint: weights per `strategy` ("tensor", "channel",
    or "block": 128 x 128, FP8_BLOCK's, on BLOCK_SIZES); activations None (weight-only), "dynamic"
    (per token; per token and group of 128 with blocks) or "static" (per tensor)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    block = strategy == "block"
    model = make_model(arch, **(BLOCK_SIZES if block else SIZES))
    amax = _input_amax(model) if acts == "static" else {}
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
                               block_structure=[128, 128] if block else None)
    inputs = None
    if acts == "dynamic":
        inputs = QuantizationArgs(num_bits=8, type="float", strategy="group" if block else "token",
                                  group_size=128 if block else None, symmetric=True, dynamic=True)
    elif acts == "static":
        inputs = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore)))
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            w = module.weight.float()
            if block:  # max |w| / 448 per block, as calculate_qparams gives per channel
                module.weight_scale.copy_(block_quantize(w)[1].reshape(module.weight_scale.shape))
                continue
            dims = None if strategy == "tensor" else 1
            lo = w.amin() if dims is None else w.amin(dims, keepdim=True)
            hi = w.amax() if dims is None else w.amax(dims, keepdim=True)
            scale, _ = calculate_qparams(lo.reshape(-1), hi.reshape(-1), scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if acts == "static":
                module.input_scale.copy_(torch.tensor(amax[name] / FP8_MAX).reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    return path


def block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [N, K], scale_inv float32 [ceil(N / block), ceil(K / block)]), w = q * scale."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scale


def save_block_fp8(path: Path, arch: str = "qwen3", config: dict[str, Any] | None = None,
                   per_tensor: bool = False, **overrides: Any) -> Path:
    """A quant_method fp8 checkpoint with weight_block_size [128, 128] (the lm_head kept float);
    `per_tensor`: instead one `weight_scale` per tensor and a static `input_scale` (calibrated as
    save_compressed_fp8 does), activation_scheme static (vLLM's Fp8Config without blocks)."""
    from safetensors.torch import load_file, save_file

    model = make_model(arch, **{**BLOCK_SIZES, **overrides})
    amax = _input_amax(model) if per_tensor else {}
    model.save_pretrained(str(path))
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        tensors = load_file(str(file))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith("_proj.weight") and t.dim() == 2 and per_tensor:
                q, s = block_quantize(t, block=max(t.shape))
                out[name], out[module + ".weight_scale"] = q, s.reshape(())
                out[module + ".input_scale"] = torch.tensor(amax[module] / FP8_MAX)
            elif name.endswith("_proj.weight") and t.dim() == 2:
                out[name], out[module + ".weight_scale_inv"] = block_quantize(t)
            else:
                out[name] = t
        save_file(out, str(file), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = config or (
        {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"} if per_tensor else
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def transformers_logits(path: Path, prompt: list[int], **kwargs: Any) -> torch.Tensor:
    """transformers' own float32 loading of the checkpoint (its quantizer dequantizes on the CPU)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def dequantized_copy(path: Path, out: Path) -> Path:
    """The fp8 checkpoint at `path` with its weights dequantized (q * the block's or the tensor's
    scale, exact in float32) and no quantization_config: transformers' FineGrainedFP8 needs accelerate to load on a
    CPU, so the reference is this float model (in float64)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        plain: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):
                continue
            scale = tensors.get(name + "_scale_inv")
            if scale is not None:
                n, k = t.shape
                full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
                t = t.float() * full
            elif name + "_scale" in tensors:  # one per tensor
                t = t.float() * tensors[name + "_scale"]
            plain[name] = t
        save_file(plain, str(file), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out
