"""QuantLinear's GPU kind for 4-bit weight-only layers (worker/models/quant_w4a16_cuda.py): which
layers take it, that quant_kinds.choose routes CUDA layers to it, and that its call (here on the
CPU, under the emulator) computes what the torch reference kind computes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from noria.kernels import instances
from noria.kernels.instances import ModuleSpec
from noria.protocol.quant_config import WeightScheme
from noria.worker.models import quant_kinds, quant_w4a16_cuda
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp

W4 = WeightScheme(bits=4, group=32, symmetric=False, packed=True, act_int8=False)


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [instances.gemm_w4a16_module("bfloat16")]


def _layer(scheme: WeightScheme, n: int = 40, k: int = 96, bias: bool = True) -> QuantLinear:
    g = torch.Generator().manual_seed(n + k)
    layer = QuantLinear(k, n, bias, scheme)
    layer.qweight.data.copy_(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    layer.weight_scale.data.copy_(torch.rand(layer.weight_scale.shape, generator=g) * 0.05 + 0.01)
    if layer.weight_zero is not None:
        layer.weight_zero.data.copy_(torch.randint(-8, 8, layer.weight_zero.shape, generator=g, dtype=torch.int8))
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(n, generator=g))
    return layer


def _on_cuda(scheme: WeightScheme, group: int, in_features: int = 96) -> Any:
    """What supports() reads of a layer on a GPU, without one."""
    return SimpleNamespace(scheme=scheme, group=group, in_features=in_features,
                           qweight=SimpleNamespace(device=torch.device("cuda"), is_meta=False))


def test_which_layers_take_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_w4a16_cuda, "cupy_usable", lambda: True)
    assert quant_w4a16_cuda.supports(_on_cuda(W4, 32))
    assert quant_w4a16_cuda.supports(_on_cuda(WeightScheme(4, None, True, True, False), 96))  # per row
    assert not quant_w4a16_cuda.supports(_on_cuda(WeightScheme(4, 8, True, True, False), 8))  # 8-feature groups
    assert not quant_w4a16_cuda.supports(_on_cuda(WeightScheme(8, 32, True, False, False), 32))  # W8A16
    assert not quant_w4a16_cuda.supports(_on_cuda(WeightScheme(8, None, True, False, True), 96))  # W8A8
    assert not quant_w4a16_cuda.supports(_on_cuda(WeightScheme(4, 32, True, True, False, minimum=True), 32))
    assert not quant_w4a16_cuda.supports(_layer(W4))  # on the CPU: the native kinds
    monkeypatch.setattr(quant_w4a16_cuda, "cupy_usable", lambda: False)
    assert not quant_w4a16_cuda.supports(_on_cuda(W4, 32))


def test_choose_routes_cuda_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class Stub:
        native, kind = True, "cuda_w4a16"

        def __init__(self, layer: Any) -> None:
            made.append(layer)

    monkeypatch.setattr(quant_w4a16_cuda, "cupy_usable", lambda: True)
    monkeypatch.setattr(quant_w4a16_cuda, "CudaW4A16", Stub)
    layer = _on_cuda(W4, 32)
    assert isinstance(quant_kinds.choose(layer), Stub) and made == [layer]
    monkeypatch.setattr(quant_w4a16_cuda, "cupy_usable", lambda: False)
    assert isinstance(quant_kinds.choose(_on_cuda(W4, 32)), TorchQuantOp)  # no CuPy: torch


@pytest.mark.parametrize("scheme", [W4, WeightScheme(4, None, True, True, False)], ids=["g32-zero", "chan-sym"])
def test_kind_computes_the_reference(emu: Any, scheme: WeightScheme, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(scheme)
    layer.bias.data = layer.bias.data.bfloat16()  # the model's dtype
    op = quant_w4a16_cuda.CudaW4A16(layer)
    from noria.kernels import gemm_w4a16

    real = gemm_w4a16.gemm_w4a16
    monkeypatch.setattr(gemm_w4a16, "gemm_w4a16", lambda x, w, b: real(x, w, b, backend=emu()))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = op(x, layer.bias)
    want = TorchQuantOp(layer)(x, layer.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 40)
    # Both round a float32 result to bfloat16 once: at most one unit in the last place apart.
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-3).all()
