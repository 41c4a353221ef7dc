"""The W4A16 GEMM (csrc/gemm_w4a16.cu) under the CPU emulator against a float64 reference: the
tensor-core kernel (float16 / bfloat16; one 16-row tile for decode, four for prefill), the
CUDA-core float32 kernel, split-K with its reduce; odd M, N not a multiple of the tiles, K not a
multiple of 16, groups of 32 / 64 / 128 and one scale per row, with and without zero points and
bias. Outputs start NaN, so a column the kernel never writes shows up. Plus the packing: the
round trip, the word layout itself, and the launch plan and argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from noria.kernels import gemm_w4a16 as w4
from noria.kernels import instances, reference
from noria.kernels.instances import ModuleSpec
from noria.kernels.scenes import TORCH_DTYPES

DTYPES = list(TORCH_DTYPES)
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
schedules = pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [instances.gemm_w4a16_module(params["dtype"])] if "dtype" in params else []


def assert_rounded_once(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    """Within half a unit in the last place of the output dtype (the float32 sum rounded once)
    plus float32 noise: rounding the running sum to 16 bits along the way does not fit."""
    nan = torch.isnan(actual)
    assert not nan.any(), f"{int(nan.sum())} NaN outputs: unwritten or read poisoned memory"
    a, e = actual.double(), expected.double()
    _, exp = torch.frexp(e)
    ulp = torch.pow(2.0, (exp - 1 - MANTISSA_BITS[dtype]).double())
    allowed = 0.5 * ulp + 1e-5 * e.pow(2).mean().sqrt()
    bad = (a - e).abs() > allowed
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} outputs off; first at {first}: "
                             f"{a[first].item()} vs {e[first].item()}, max |diff| {(a - e).abs().max().item():.3g}")


def make_weight(n: int, k: int, group: int, with_zero: bool,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    # Scales spread over a factor of 30, so that a scale from the wrong group shows.
    scale = (torch.rand(n, k // group, generator=g) * 0.29 + 0.01) / k**0.5
    zero = torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8) if with_zero else None
    return q, scale, zero


# (M, N, K, group (0: one scale per row), split (None: the plan's)): decode rows on one 16-row
# tile (1, odd 5, a full 16) and prefill rows on 64-row tiles (37, and 70 over two); N with a
# partial last 16-column tile and a partial 64-column CTA; a K that is no multiple of 16 with
# one scale per row; split-K forced both ways.
CASES = [
    (1, 200, 256, 32, None),
    (5, 72, 192, 64, 1),
    (16, 40, 128, 128, 3),
    (3, 24, 200, 0, None),
    (37, 100, 256, 64, 1),
    (70, 48, 128, 32, None),
]


def case_id(c: tuple[Any, ...]) -> str:
    m, n, k, group, split = c
    return f"m{m}-n{n}-k{k}-" + (f"g{group}" if group else "chan") + f"-split{split or 'auto'}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("with_zero", [True, False], ids=["zero", "sym"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@schedules
def test_gemm_w4a16(emu: Any, schedule: str, with_bias: bool, with_zero: bool, case: tuple[Any, ...],
                    dtype: str) -> None:
    m, n, k, group, split = case
    group = group or k
    t = TORCH_DTYPES[dtype]
    q, scale, zero = make_weight(n, k, group, with_zero, seed=m * 1000 + n + k)
    g = torch.Generator().manual_seed(k + m)
    # x as rows of a wider buffer: the row stride is free.
    x = torch.randn(m, k + 8, generator=g).to(t)[:, :k]
    bias = torch.randn(n, generator=g).to(t) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=t)
    y = w4.gemm_w4a16(x, w4.pack_w4a16(q, scale, zero, group), bias, out=out, split=split, backend=emu(schedule))
    assert y.data_ptr() == out.data_ptr()
    assert_rounded_once(y, reference.gemm_w4a16(x, q, scale, zero, group, bias), dtype)


def test_tolerance_rejects_a_sum_rounded_per_group() -> None:
    """The check the half-precision mutant must fail: a float16 running sum rounded at every
    group of 32 is out of tolerance somewhere in 1 x 200 outputs."""
    q, scale, zero = make_weight(200, 256, 32, True, seed=1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).half()
    w = q.double().view(200, -1, 32) - zero.double()[..., None]
    parts = torch.einsum("mgk,ngk->mng", x.double().view(1, -1, 32), w) * scale.double()[None]
    acc = torch.zeros(1, 200, dtype=torch.float16)
    for i in range(parts.shape[-1]):
        acc = (acc.double() + parts[..., i]).half()
    with pytest.raises(AssertionError):
        assert_rounded_once(acc, reference.gemm_w4a16(x, q, scale, zero, 32), "float16")


def test_leading_dims_and_empty_rows(emu: Any) -> None:
    q, scale, zero = make_weight(24, 64, 32, True, seed=5)
    w = w4.pack_w4a16(q, scale, zero, 32)
    x = torch.randn(2, 3, 64).half()
    y = w4.gemm_w4a16(x, w, backend=emu())
    assert y.shape == (2, 3, 24)
    assert_rounded_once(y, reference.gemm_w4a16(x.view(6, 64), q, scale, zero, 32).view(2, 3, 24), "float16")
    assert w4.gemm_w4a16(torch.empty(0, 64).half(), w, backend=emu()).shape == (0, 24)


@pytest.mark.parametrize("shape", [(16, 64, 64), (40, 200, 0), (3, 128, 32)], ids=str)
@pytest.mark.parametrize("with_zero", [True, False], ids=["zero", "sym"])
def test_pack_round_trip(shape: tuple[int, int, int], with_zero: bool) -> None:
    n, k, group = shape
    q, scale, zero = make_weight(n, k, group or k, with_zero, seed=n + k)
    w = w4.pack_w4a16(q, scale, zero, group or k)
    assert w.words.shape == (-(-n // 16), -(-k // 64), 32, 4) and w.words.dtype == torch.int32
    q2, scale2, zero2 = w4.unpack_w4a16(w)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)
    assert (zero2 is None) == (zero is None) and (zero is None or torch.equal(zero2, zero))
    expected = reference.gemm_w4a16(torch.eye(k, dtype=torch.float64), q, scale, zero, group or k).t()
    assert torch.allclose(w4.dequantize(w).double(), expected, rtol=1e-6, atol=0)


def test_word_layout() -> None:
    """Lane (g, t)'s word of tile (0, 0) holds W[8j + g][2t + 8h + e] + 8 at bit 4 (2j + h) + 16 e:
    the pair of one mma B register 16 bits apart (checked on distinct values per position)."""
    n, k = 16, 64
    q = ((torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :]) % 16 - 8).to(torch.int8)
    w = w4.pack_w4a16(q, torch.ones(n, 1), None, k)
    words = w.words.to(torch.int64) & 0xFFFFFFFF
    for lane in (0, 5, 31):
        g, t = divmod(lane, 4)
        for step in range(4):
            word = int(words[0, 0, lane, step])
            for j in range(2):
                for h in range(2):
                    for e in range(2):
                        nibble = (word >> (4 * (2 * j + h) + 16 * e)) & 0xF
                        assert nibble == int(q[8 * j + g, 16 * step + 2 * t + 8 * h + e]) + 8


def test_pack_rejects() -> None:
    q, scale, _ = make_weight(16, 96, 32, False, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        w4.pack_w4a16(q, torch.ones(16, 4), None, 24)
    with pytest.raises(ValueError, match="scale must be"):
        w4.pack_w4a16(q, scale[:, :2], None, 32)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        w4.pack_w4a16(q * 2, scale, None, 32)


def test_launch_checks() -> None:
    q, scale, _ = make_weight(16, 64, 32, False, seed=0)
    w = w4.pack_w4a16(q, scale, None, 32)
    with pytest.raises(ValueError, match="input features"):
        w4.gemm_w4a16(torch.zeros(2, 32).half(), w)
    with pytest.raises(ValueError, match="bias"):
        w4.gemm_w4a16(torch.zeros(2, 64).half(), w, torch.zeros(16))
    with pytest.raises(ValueError, match="out must be"):
        w4.gemm_w4a16(torch.zeros(2, 64).half(), w, out=torch.zeros(2, 17).half())
    with pytest.raises(TypeError, match="unsupported dtype"):
        w4.gemm_w4a16(torch.zeros(2, 64, dtype=torch.float64), w)


def test_plan() -> None:
    decode = w4.plan_w4a16(1, 4096, 4096, "bfloat16", sm_count=132)
    assert decode.name == "gemm_w4a16_tc<__nv_bfloat16, 1>"
    assert decode.grid[:2] == (64, 1) and decode.splits > 1  # 64 CTAs cannot fill 132 SMs
    assert decode.blocks_per_split * decode.splits >= 64 > decode.blocks_per_split * (decode.splits - 1)
    prefill = w4.plan_w4a16(256, 4096, 4096, "float16", sm_count=132)
    assert prefill.name == "gemm_w4a16_tc<__half, 4>" and prefill.grid == (64, 4, 1)
    assert w4.plan_w4a16(8, 64, 64, "float32", 132).name == "gemm_w4a16_simt<float>"
    assert w4.plan_w4a16(1, 64, 64 * 5, "float16", 132, split=3).grid[2] == 3
    assert w4.plan_w4a16(1, 64, 64 * 2, "float16", 132, split=8).splits == 2  # never an empty split
