"""The kinds a QuantLinear computes in: the native CPU GEMMs over packed integer weights
(worker/gemm_quant_kernels.py), else the torch reference (worker/models/quant_linear.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from noria.protocol import switches
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp


class _Packed:
    """A native kind: the kernel's packed copy of the layer's weight and the call over it. The
    native decoder stack reads the packed weight's descriptor (`desc_ptr`) through one entry
    that dispatches on it (worker/native_stack.py)."""

    native = True
    kind = ""

    def __init__(self, packed: object, gemm: Callable[..., torch.Tensor]) -> None:
        self.packed, self._gemm = packed, gemm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._gemm(x, self.packed, bias)

    @property
    def desc_ptr(self) -> int | None:
        return getattr(self.packed, "desc_ptr", None)


def _groups(layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return layer.weight_scale.data, None if layer.weight_zero is None else layer.weight_zero.data


def _minimum(layer: QuantLinear) -> torch.Tensor | None:
    return None if layer.weight_min is None else layer.weight_min.data


class PackedW8A8(_Packed):
    """int8 weights, activations quantized per row inside the call, int32 sums (VNNI where built)."""

    kind = "packed_w8a8"

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_kernels as g

        super().__init__(g.PackedInt8Weight(layer.qweight.data, layer.weight_scale.data[:, 0].contiguous()),
                         g.gemm_w8a8)


class PackedWeightOnly(_Packed):
    """4- or 8-bit weights with group scales (and zero points), widened to float32 in the kernel."""

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_kernels as g

        super().__init__(g.PackedGroupWeight(layer.qweight.data, *_groups(layer), layer.group, layer.scheme.bits),
                         g.gemm_wq)
        self.kind = f"packed_w{layer.scheme.bits}a16"


class PackedW4A8(_Packed):
    """4-bit weights (group scales; zero points, or GGUF's float minimums) against activations
    rounded to int8 per row and group of the weights' group size, int32 sums per group: the
    int8 dot products' rate (vpdpbusd) on half W8A8's bytes. One scale per group of activations
    rather than per row keeps an outlier feature from flattening the rest of its row (llama.cpp
    quantizes activations in blocks for the same reason)."""

    kind = "packed_w4a8"

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_groups as g

        super().__init__(g.PackedInt4Weight(layer.qweight.data, *_groups(layer), layer.group, minimum=_minimum(layer)),
                         g.gemm_w4a8)


class PackedW8A8g(_Packed):
    """8-bit weight-only schemes (GGUF Q8_0, Q6_K and the merged Q4_K / Q6_K layers with their
    minimums, compressed-tensors W8A16) on activations rounded to int8 per row and group of the
    weights' group size, as PackedW4A8 (llama.cpp computes Q8_0 and Q6_K against int8 blocks
    too): int32 sums per group at the int8 dot products' rate, where float32 activations run at
    the float32 GEMM's speed at best (and minimums had only the torch reference)."""

    kind = "packed_w8a8g"

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_quant_groups as g

        super().__init__(g.PackedInt8GroupWeight(layer.qweight.data, *_groups(layer), layer.group,
                                                 minimum=_minimum(layer)), g.gemm_w8a8g)


def native_usable(layer: QuantLinear) -> bool:
    if layer.qweight.device.type != "cpu":
        return False
    try:
        from noria.worker import gemm_quant_kernels
    except ImportError:
        return False
    return gemm_quant_kernels.usable()


def choose(layer: QuantLinear) -> PackedW8A8 | PackedW4A8 | PackedW8A8g | PackedWeightOnly | TorchQuantOp:
    """W8A8 as the checkpoint says; 4- and 8-bit weight-only schemes on activations rounded to int8
    per group (PackedW4A8, PackedW8A8g) unless $NORIA_CPU_W4A16 keeps them on float32 ones (or the
    group is not a multiple of 4, as a per-channel layer's odd K)."""
    if layer.scheme.kind == "fp8":  # e4m3 values: kinds of their own (worker/models/quant_fp8.py)
        from noria.worker.models import quant_fp8

        return quant_fp8.choose(layer)  # type: ignore[return-value]
    if layer.qweight.device.type == "cuda":  # 4-bit weight-only: the CuPy dequant-GEMM
        from noria.worker.models import quant_w4a16_cuda

        if quant_w4a16_cuda.supports(layer):
            return quant_w4a16_cuda.CudaW4A16(layer)  # type: ignore[return-value]
    if not native_usable(layer):
        return TorchQuantOp(layer)
    if layer.scheme.act_int8:
        return PackedW8A8(layer)
    if layer.group % 4 == 0 and not switches.cpu_w4a16():
        if layer.scheme.bits == 4:
            return PackedW4A8(layer)
        from noria.worker import gemm_quant_groups

        if layer.scheme.bits == 8 and layer.group <= gemm_quant_groups.MAX_W8A8G_GROUP:
            return PackedW8A8g(layer)
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
    if "native_fp8" in kinds:
        from noria.worker import gemm_fp8_kernels

        isa += f" (fp8: {gemm_fp8_kernels.isa()}, {gemm_fp8_kernels.layout()})"
    return f"quantized weights: {quant}; kinds: " + ", ".join(f"{k} x {n}" for k, n in sorted(kinds.items())) + isa
