"""The block-scaled FP8 kind (worker/models/quant_fp8.py, BlockScaledMmFp8): one torch._scaled_mm
with 1x128 activation groups and 128x128 weight blocks. The CPU build has no block recipe, so the
call is checked against an emulation of the contract torch's CUDA build enforces (ScaledBlas.cpp:
scale_a [M, K/128] with strides (1, M), scale_b [K/128, N/128] whose transpose is contiguous, an
explicit out_dtype) and the arithmetic it documents; and the load-time check picks it only where
it agrees with the reference, falling back to the loop of row-wise GEMMs everywhere else."""

from __future__ import annotations

import pytest
import torch

from noria.protocol.quant_fp8 import _scheme
from noria.worker.dummy_weights import _fill_quant, _generator
from noria.worker.models import quant_fp8
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp

_CPU_SCALED_MM = torch._scaled_mm


def _layer(n: int = 384, k: int = 512, seed: int = 0) -> QuantLinear:
    layer = QuantLinear(k, n, False, _scheme(128, "dynamic", "fp8"))
    for name in ("qweight", "weight_scale"):
        _fill_quant(getattr(layer, name).data, name, layer, _generator(seed, name, torch.device("cpu")))
    return layer


def _block_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     out_dtype: torch.dtype | None = None, **_: object) -> torch.Tensor:
    """torch's (BlockWise1x128, BlockWise128x128) recipe, its layout checks included; row-wise
    calls (the loop's) go to the CPU build's own."""
    if scale_a.shape[-1] == 1:
        return _CPU_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    m, k = a.shape
    n = b.shape[1]
    g = -(-k // 128)
    assert out_dtype is not None, "the block recipe needs an explicit out_dtype"
    assert m % 4 == 0, "cuBLASLt wants the scale_a leading dimension 16-byte aligned"
    assert scale_a.shape == (m, g) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (g, -(-n // 128)) and scale_b.t().is_contiguous()
    a32 = a.float().reshape(m, g, 128) * scale_a[:, :, None]
    w = b.t().float().reshape(n, g, 128) * scale_b.t().repeat_interleave(128, dim=0)[:n, :, None]
    return (a32.reshape(m, k) @ w.reshape(n, k).t()).to(out_dtype)


def test_one_call_matches_the_reference_and_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    assert quant_fp8.BlockScaledMmFp8.fits(layer)
    x = torch.randn(13, layer.in_features) * 3  # 13 rows: padded to 16 for the call, cut back after
    want = TorchQuantOp(layer)(x, None)
    loop = quant_fp8.ScaledMmFp8(layer, torch.float32)(x, None)
    monkeypatch.setattr(torch, "_scaled_mm", _block_scaled_mm)
    got = quant_fp8.BlockScaledMmFp8(layer, torch.float32)(x, None)
    assert got.shape == want.shape
    # The same rounding of activations per token and group as the loop, so the same values.
    torch.testing.assert_close(got, loop, rtol=1e-4, atol=1e-4 * float(loop.abs().max()))
    assert float((got - want).abs().max()) < 0.1 * float(want.abs().max())


def test_the_load_time_check_picks_the_block_call_only_where_it_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    # The CPU's _scaled_mm refuses block scales: the loop of row-wise GEMMs it is.
    assert isinstance(quant_fp8._probed(layer), quant_fp8.ScaledMmFp8)
    monkeypatch.setattr(torch, "_scaled_mm", _block_scaled_mm)
    assert isinstance(quant_fp8._probed(layer), quant_fp8.BlockScaledMmFp8)

    def wrong(a: torch.Tensor, b: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
        got = _block_scaled_mm(a, b, **kw)  # type: ignore[arg-type]
        return got if kw["scale_a"].shape[-1] == 1 else got * 2  # a build whose block recipe is wrong

    monkeypatch.setattr(torch, "_scaled_mm", wrong)
    assert isinstance(quant_fp8._probed(layer), quant_fp8.ScaledMmFp8)  # the loop, which agrees


def test_scales_that_are_not_whole_blocks_keep_the_loop() -> None:
    layer = _layer()
    layer.weight_scale.data[5] *= 2  # one row of a 128-row block scaled apart from the rest
    assert not quant_fp8.BlockScaledMmFp8.fits(layer)
    per_channel = QuantLinear(512, 384, False, _scheme(None, "dynamic", "online"))
    assert not quant_fp8.BlockScaledMmFp8.fits(per_channel)
