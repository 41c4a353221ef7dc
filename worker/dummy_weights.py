"""`--load-format dummy` (vLLM's): a model's weights made from its config alone, seeded, directly
on its device, so that a benchmark of an 8B shape neither writes nor reads 16 GB of safetensors.

Every parameter slot a checkpoint would fill (CausalLM.weight_map) is filled instead: float
tensors uniform in [-1e-3, 1e-3] as vLLM's dummy loader makes them, norm weights 1 (a norm of
tiny weights would scale every hidden state towards zero). Quantized layers get valid quantized
tensors of their scheme: integer values over the scheme's whole range with positive group scales
(and zero points in range), e4m3 values with scales that put the dequantized weights in the same
small range, one scale per 128 x 128 block where the scheme is block-scaled. An online-fp8 layer's
float weight is made like any float weight and quantized at pack time, as from a checkpoint.

Each slot draws from its own generator, seeded by the engine's seed and the slot's name, so a
tensor does not depend on the order of the others, and every tensor-parallel rank makes the same
replicated tensors. The values differ between devices (their generators differ), as vLLM's do.
"""

from __future__ import annotations

import zlib

import torch

from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.quant_linear import QuantLinear

RANGE = 1e-3  # vLLM's dummy weights: uniform in [-RANGE, RANGE]
FP8_MAX = 448.0


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return g


def _uniform(t: torch.Tensor, low: float, high: float, g: torch.Generator) -> None:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no RNG kernels for 8-bit floats
        t.copy_(torch.empty(t.shape, device=t.device).uniform_(low, high, generator=g).to(t.dtype))
    else:
        t.uniform_(low, high, generator=g)


def _fill_quant(t: torch.Tensor, suffix: str, layer: QuantLinear, g: torch.Generator) -> None:
    s = layer.scheme
    fp8 = s.kind == "fp8"
    qmax = FP8_MAX if fp8 else float(1 << (s.bits - 1))
    if suffix == "input_scale":  # one calibrated scale per tensor, kept per row
        t.fill_(float(torch.empty(1, device=t.device).uniform_(0.5, 1.0, generator=g)) * 1e-2)
    elif t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):  # scales
        if fp8 and s.group is not None:  # one scale per 128 x 128 block, repeated over its rows
            blocks = torch.empty(-(-t.shape[0] // s.group), t.shape[1], device=t.device)
            blocks.uniform_(0.5, 1.0, generator=g)
            t.copy_(blocks.repeat_interleave(s.group, dim=0)[: t.shape[0]])
        else:
            t.uniform_(0.5, 1.0, generator=g)
        t.mul_(RANGE / qmax)
    elif fp8:  # e4m3 values over the format's range
        _uniform(t, -FP8_MAX, FP8_MAX, g)
    else:  # integer values (and zero points) over the scheme's range, in int8 containers
        t.random_(-(1 << (s.bits - 1)), 1 << (s.bits - 1), generator=g)


def fill_dummy(model: CausalLM, seed: int) -> None:
    """Fill every weight of `model` (built on its device, this rank's shard) as described above;
    ValueError for schemes whose tensors have no dummy form here."""
    if model.spec.quantization is not None and model.spec.quantization.method == "gguf":
        raise ValueError("--load-format dummy makes weights from config.json; a GGUF file brings its own")
    wm = model.weight_map()  # makes the tensors an online or static-scale layer fills, too
    quant: dict[int, QuantLinear] = {}
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            if layer.scheme.minimum or layer.scheme.act_order:
                raise ValueError(f"--load-format dummy has no random form of {layer.scheme.name} weights "
                                 f"({layer.scheme.layout}, {'minimums' if layer.scheme.minimum else 'act_order'})")
            for p in (layer.qweight, layer.weight_scale, layer.weight_zero, getattr(layer, "input_scale", None)):
                if p is not None:
                    quant[id(p)] = layer
    with torch.no_grad():
        for slot in wm.slots:
            t = slot.param.data
            g = _generator(seed, slot.name, t.device)
            layer = quant.get(id(slot.param))
            if layer is not None:
                _fill_quant(t, slot.name.rsplit(".", 1)[-1], layer, g)
            elif slot.name.endswith("norm.weight") or slot.name.endswith("norm"):
                # A (1 + w) norm holds 1 + w already (decoder.register_norm): 1 either way.
                t.fill_(1.0)
            elif t.is_floating_point():
                _uniform(t, -RANGE, RANGE, g)
            else:
                raise ValueError(f"--load-format dummy: no random form of {slot.name} ({t.dtype})")
