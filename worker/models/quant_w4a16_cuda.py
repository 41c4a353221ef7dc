"""The GPU kind of 4-bit weight-only layers (W4A16): the CuPy dequant-GEMM of
kernels/gemm_w4a16.py over a copy of the weight packed once at load (16 x 16 tiles of nibbles,
a lane's word is its mma operand), in place of the torch reference's float32 dequantize-and-matmul
per call."""

from __future__ import annotations

import functools
import logging

import torch

from noria.worker.models.quant_linear import QuantLinear

log = logging.getLogger(__name__)


@functools.cache
def cupy_usable() -> bool:
    """CuPy imports, sees a device and loads NVRTC (once per process; a missing `noria[cuda]`
    leaves these layers on the torch reference)."""
    try:
        from noria.kernels.backends import CupyBackend

        CupyBackend().check()
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        log.info("W4A16 layers stay on torch: CuPy is not usable (%s: %s)", type(e).__name__, e)
        return False
    return True


def supports(layer: QuantLinear) -> bool:
    """A 4-bit integer weight-only layer on a CUDA device whose groups the kernel walks in 16-feature
    steps (or one scale per row), where CuPy works."""
    s = layer.scheme
    if layer.qweight.device.type != "cuda" or layer.qweight.is_meta:
        return False
    if s.bits != 4 or s.act_int8 or s.minimum or s.kind != "int":
        return False
    if layer.group != layer.in_features and layer.group % 16:
        return False
    return cupy_usable()


class CudaW4A16:
    """y = x @ dequant(W).T + b on tensor cores (float16 / bfloat16 activations) or CUDA cores
    (float32), float32 sums scaled per group. Holds only the packed copy: QuantLinear.pack drops
    the int8 tensors (native)."""

    native = True
    kind = "cuda_w4a16"

    def __init__(self, layer: QuantLinear) -> None:
        from noria.kernels.gemm_w4a16 import pack_w4a16

        zero = None if layer.weight_zero is None else layer.weight_zero.data
        self.packed = pack_w4a16(layer.qweight.data, layer.weight_scale.data, zero, layer.group)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from noria.kernels.gemm_w4a16 import gemm_w4a16

        return gemm_w4a16(x, self.packed, None if bias is None else bias.to(x.dtype))
