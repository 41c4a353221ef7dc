"""Quantized checkpoints made by compressed-tensors (what llm-compressor writes), for the
benchmarks and the tests: a float model's Linear layers given a scheme, each weight's scales
from its own range (min-max; llm-compressor's default observer), then compressed-tensors'
compressor packs and saves them with their `quantization_config`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The schemes by name: llm-compressor's presets (W4A16 is groups of 128, symmetric; W8A8 int8
# channel weights with dynamic per-token activations), and smaller groups the tiny test models
# divide.
SCHEMES: dict[str, dict[str, Any]] = {
    "w8a8": {"weights": {"num_bits": 8, "strategy": "channel"},
             "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}},
    "w8a16": {"weights": {"num_bits": 8, "strategy": "channel"}, "format": "pack-quantized"},
    "w4a16": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128}},
    "w4a16_g32": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}},
    "w4a16_g64_asym": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False}},
    # llm-compressor's FP8_DYNAMIC: e4m3 channel weights, activations e4m3 per token on the fly.
    "fp8": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
}


def quantize_model(model: Any, scheme: str, ignore: tuple[str, ...] = ("lm_head",)) -> Any:
    """Quantize a transformers model's Linear layers in place by `scheme` (compressed-tensors'
    lifecycle: apply the config, set each weight's scale and zero point from its range, compress);
    returns the compressor, whose `update_config(folder)` writes the config once the model is saved."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    spec = SCHEMES[scheme]
    args = {k: QuantizationArgs(**{"type": "int", "symmetric": True, "dynamic": False, **v}) if k != "format" else v
            for k, v in spec.items()}
    group = QuantizationScheme(targets=["Linear"], **args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if weights is None:
                continue
            w = module.weight.float()
            if weights.strategy == "group":
                w = w.reshape(w.shape[0], -1, weights.group_size)
                lo, hi = w.amin(-1), w.amax(-1)
            else:
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            scale, zero = calculate_qparams(lo, hi, weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def save_quantized(model: Any, path: Path, scheme: str, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    compressor = quantize_model(model, scheme, ignore)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    return path


def quantized_checkpoint(base: Path, scheme: str) -> Path:
    """`base` (a float benchmark checkpoint) quantized by `scheme`, cached beside it."""
    path = base.with_name(f"{base.name}-{scheme}")
    if (path / "complete").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    from noria.bench.workloads import write_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16).eval()
    return write_checkpoint(path, lambda tmp: save_quantized(model, tmp, scheme), base)
