"""The kinds a QuantLinear computes in: the native CPU GEMMs over packed integer weights
(worker/gemm_quant_kernels.py), else the torch reference (worker/models/quant_linear.py)."""

from __future__ import annotations

from collections import Counter

import torch

from noria.protocol import switches
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp


class PackedW8A8:
    """int8 weights, activations quantized per row inside the call, int32 sums (VNNI where built)."""

    native = True

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_kernels

        self._gemm = gemm_quant_kernels.gemm_w8a8
        self.packed = gemm_quant_kernels.PackedInt8Weight(layer.qweight.data, layer.weight_scale.data[:, 0].contiguous())
        self.kind = "packed_w8a8"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._gemm(x, self.packed, bias)

    # The native decoder stack calls the kernel's descriptor entry (gemm_f32's arguments, the
    # descriptor in place of the panels): worker/native_stack.py.
    desc_ptr = property(lambda self: getattr(self.packed, "desc_ptr", None))
    entry = property(lambda self: _entry("w8a8"))


class PackedWeightOnly:
    """4- or 8-bit weights with group scales (and zero points), widened to float32 in the kernel."""

    native = True

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_kernels

        zero = None if layer.weight_zero is None else layer.weight_zero.data
        self._gemm = gemm_quant_kernels.gemm_wq
        self.packed = gemm_quant_kernels.PackedGroupWeight(layer.qweight.data, layer.weight_scale.data, zero,
                                                           layer.group, layer.scheme.bits)
        self.kind = f"packed_w{layer.scheme.bits}a16"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._gemm(x, self.packed, bias)

    desc_ptr = property(lambda self: getattr(self.packed, "desc_ptr", None))
    entry = property(lambda self: _entry("wq"))


class PackedW4A8:
    """4-bit weights (group scales; zero points, or GGUF's float minimums) against activations
    rounded to int8 per row and group of the weights' group size, int32 sums per group: the
    int8 dot products' rate (vpdpbusd) on half W8A8's bytes. One scale per group of activations
    rather than per row keeps an outlier feature from flattening the rest of its row (llama.cpp
    quantizes activations in blocks for the same reason)."""

    native = True

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_kernels

        zero = None if layer.weight_zero is None else layer.weight_zero.data
        minimum = getattr(layer, "weight_min", None)
        self._gemm = gemm_quant_kernels.gemm_w4a8
        self.packed = gemm_quant_kernels.PackedInt4Weight(layer.qweight.data, layer.weight_scale.data, zero,
                                                          layer.group,
                                                          minimum=None if minimum is None else minimum.data)
        self.kind = "packed_w4a8"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._gemm(x, self.packed, bias)

    desc_ptr = property(lambda self: getattr(self.packed, "desc_ptr", None))
    entry = property(lambda self: _entry("w4a8"))


def _entry(kind: str) -> int:
    from noria.worker import gemm_quant_kernels

    return gemm_quant_kernels.entry(kind)


def native_usable(layer: QuantLinear) -> bool:
    if layer.qweight.device.type != "cpu":
        return False
    try:
        from noria.worker import gemm_quant_kernels
    except ImportError:
        return False
    return gemm_quant_kernels.usable()


def choose(layer: QuantLinear) -> PackedW8A8 | PackedW4A8 | PackedWeightOnly | TorchQuantOp:
    """W8A8 as the checkpoint says; 4-bit weights on int8 activations (PackedW4A8) unless
    $NORIA_CPU_W4A16 keeps them on float32 ones; 8-bit weight-only schemes on float32."""
    if not native_usable(layer):
        return TorchQuantOp(layer)
    if layer.scheme.act_int8:
        return PackedW8A8(layer)
    if layer.scheme.bits == 4 and layer.group % 4 == 0 and not switches.cpu_w4a16():
        return PackedW4A8(layer)
    # GGUF's minimums (Q4_K, and a fused layer of Q4_K and Q6_K parts) have no float-activation
    # kernel: the torch reference, which dequantizes per call.
    return TorchQuantOp(layer) if layer.scheme.minimum else PackedWeightOnly(layer)


def describe(model: torch.nn.Module, quant: str) -> str:
    """The start-up line of a quantized model: its scheme and the kinds its layers took."""
    kinds = Counter(m.op.kind for m in model.modules() if isinstance(m, QuantLinear))
    isa = ""
    if any(k.startswith("packed_") for k in kinds):
        from noria.worker import gemm_quant_kernels

        isa = f" ({gemm_quant_kernels.isa()})"
    return f"quantized weights: {quant}; kinds: " + ", ".join(f"{k} x {n}" for k, n in sorted(kinds.items())) + isa
