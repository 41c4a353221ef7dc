"""The W4A16 GEMM on a real GPU (bin/gpu-session's test phase), at model shapes: through CuPy on
torch's stream, against torch's matmul of the dequantized weight (float32) and the float64
reference on a slice. Skips where CUDA is not available; the emulated tests cover the contract
everywhere else (test_gemm_w4a16.py)."""

from __future__ import annotations

import pytest
import torch

from noria.kernels import gemm_w4a16 as w4
from noria.kernels import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")

# (M, N, K, group): decode (split-K) and prefill rows at a 7-8B model's projections, a per-row
# scale, a ragged N.
SHAPES = [(1, 4096, 4096, 128), (7, 11008, 4096, 128), (16, 4096, 11008, 64), (256, 4096, 4096, 128),
          (33, 1000, 4096, 4096), (300, 520, 1024, 32)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_zero", [True, False], ids=["zero", "sym"])
def test_against_torch_dequantized_matmul(shape: tuple[int, int, int, int], dtype: torch.dtype,
                                          with_zero: bool) -> None:
    m, n, k, group = shape
    g = torch.Generator().manual_seed(m + n)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=g) * 0.3 + 0.01) / k**0.5
    zero = torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8) if with_zero else None
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = w4.pack_w4a16(q.to(CUDA), scale.to(CUDA), None if zero is None else zero.to(CUDA), group)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=CUDA)
    w4.gemm_w4a16(x.to(CUDA), packed, bias.to(CUDA), out=out)
    torch.cuda.synchronize()
    # torch's way: dequantize to float32, matmul (TF32 off), round once to the dtype.
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        want = torch.nn.functional.linear(x.to(CUDA).float(), w4.dequantize(packed), bias.to(CUDA).float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    err = (out.float() - want).abs() / (want.abs() + want.pow(2).mean().sqrt() * 0.1)
    assert not torch.isnan(out).any() and err.max().item() <= tol, err.max().item()
    rows = slice(0, min(m, 4))
    exact = reference.gemm_w4a16(x[rows], q, scale, zero, group, bias)
    assert ((out[rows].cpu().double() - exact).abs() <= (exact.abs() + 1) * tol).all()
