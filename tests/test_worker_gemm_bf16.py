"""The native GEMM over 16-bit weights (worker/csrc/gemm_bf16.c), every layout: "widen" (bf16) and
"f16" against a float64 reference on the rounded weight and bit for bit against the float32
native GEMM on that weight; "dot" (AVX512_BF16) against a float64 reference on the bf16-rounded
weight and activations, within float32's summation error."""

from __future__ import annotations

import platform

import pytest
import torch

from noria.worker import gemm_bf16_kernels, gemm_kernels
from noria.worker.gemm_bf16_kernels import PackedHalfWeight, gemm_bf16
from noria.worker.models.linear import PackedHalfLinear
from tests.bf16_rounding import check_rounded, rounding_rows

pytestmark = pytest.mark.skipif(gemm_bf16_kernels.load() is None,
                                reason="no C compiler: the native bf16 GEMM is not built")

ROWS = [0, 1, 2, 5, 6, 7, 13, 64, 130, 300]
SHAPES = [(1, 1), (17, 3), (96, 80), (257, 769), (1, 769), (257, 1)]  # (N, K): odd on purpose


def _case(rows: int, n: int, k: int, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight, x as a strided view (a column slice of a wider tensor), a bias or None."""
    torch.manual_seed(rows * 10_000 + n * 100 + k)
    weight = torch.randn(n, k)
    x = torch.randn(rows, k + 9)[:, 4 : 4 + k]
    return weight, x, torch.randn(n) if with_bias else None


def _float32_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The float32 native GEMM on the weight rounded to `dtype`: the same in-order fused sum per output."""
    if gemm_kernels.load() is None:
        pytest.skip("the float32 native GEMM is off")
    return gemm_kernels.gemm(x, gemm_kernels.PackedWeight(weight.to(dtype).float()), bias)


def _dot_built() -> bool:
    return bool(gemm_bf16_kernels._dll().gemm_bf16_dot_built())


def _cpu_has_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


def _cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return "avx512f" in next((line for line in f if line.startswith("flags")), "").split()


def test_the_dot_kernel_is_built_exactly_where_the_cpu_has_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from noria.protocol import switches
    from noria.worker import gemm_amx_kernels

    assert _dot_built() == _cpu_has_bf16()
    tiles = _cpu_has_bf16() and gemm_amx_kernels.ready() and not switches.cpu_no_amx()
    assert gemm_bf16_kernels.layout() == ("amx" if tiles else "dot" if _cpu_has_bf16() else "widen")
    monkeypatch.setenv("NORIA_CPU_NO_AMX", "1")
    assert gemm_bf16_kernels.layout() == ("dot" if _cpu_has_bf16() else "widen")
    monkeypatch.setenv("NORIA_CPU_BF16_WIDEN", "1")
    assert gemm_bf16_kernels.layout() == "widen"


LAYOUTS = ["widen", "f16", pytest.param("dot", marks=pytest.mark.skipif(
    not _cpu_has_bf16(), reason="the dot kernel needs AVX512_BF16, which this CPU lacks"))]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_dot_matches_float64_on_bf16_inputs(rows: int, n: int, k: int, with_bias: bool) -> None:
    if not _cpu_has_bf16():
        pytest.skip("the dot kernel needs AVX512_BF16, which this CPU lacks")
    weight, x, bias = _case(rows, n, k, with_bias)
    got = gemm_bf16(x, PackedHalfWeight(weight, "dot"), bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    xb, wb = x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double()
    want = xb @ wb.T + (0 if bias is None else bias.double())
    # Each output is one float32 sum of k products: off by at most ~k ulps of the sum of |terms|.
    bound = 2.0**-23 * (k + 2) * (xb.abs() @ wb.abs().T + (0 if bias is None else bias.double().abs()))
    assert ((got.double() - want).abs() <= bound).all()
    # The kernel computes on bf16 x, not on float32 x: float32's summation error is orders of
    # magnitude below what rounding x moves the result by.
    if rows and n and k > 1:
        exact = x.double() @ wb.T + (0 if bias is None else bias.double())
        assert (got.double() - want).norm() < 1e-2 * (exact - want).norm()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("layout", "dtype"), [("widen", torch.bfloat16), ("f16", torch.float16)])
def test_matches_float64_and_the_float32_gemm_bit_for_bit(rows: int, n: int, k: int, with_bias: bool, layout: str,
                                                          dtype: torch.dtype) -> None:
    weight, x, bias = _case(rows, n, k, with_bias)
    assert rows < 2 or not x.is_contiguous()
    got = gemm_bf16(x, PackedHalfWeight(weight, layout), bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = x.double() @ weight.to(dtype).double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)
    assert torch.equal(got, _float32_gemm(x, weight, bias, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [80, 81])
def test_a_half_weight_packs_as_its_float32_copy_and_unpacks(layout: str, k: int) -> None:
    torch.manual_seed(1)
    half = torch.randn(257, k).to(gemm_bf16_kernels.LAYOUT_DTYPES[layout])
    from_half, from_f32 = PackedHalfWeight(half, layout), PackedHalfWeight(half.float(), layout)
    assert (from_half.n, from_half.k) == (257, k)
    assert torch.equal(from_half.data, from_f32.data)
    x = torch.randn(7, k)
    assert torch.equal(gemm_bf16(x, from_half, None), gemm_bf16(x, from_f32, None))
    assert from_half.unpack().dtype == half.dtype and torch.equal(from_half.unpack(), half)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_weights_round_to_nearest_even(layout: str) -> None:
    """1 + 2^-8 lies halfway between two bf16 values: it rounds to even (1.0), 1 + 3 * 2^-8 up;
    1 + 2^-11 and 1 + 3 * 2^-11 the same for float16, whose largest finite value is 65504."""
    if layout == "f16":
        values = [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-12), 65504.0, 65520.0, -7e4, 2**-24, 2**-25, 3 * 2**-26]
    else:
        values = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9)]
    weight = torch.tensor(values).reshape(-1, 1)  # y = 1 * w: an infinity stays one, no 0 * inf
    out = gemm_bf16(torch.ones(1, 1), PackedHalfWeight(weight, layout), None)[0]
    assert torch.equal(out, weight[:, 0].to(gemm_bf16_kernels.LAYOUT_DTYPES[layout]).float())
    assert out[:2].tolist() == ([1.0, 1 + 2**-9] if layout == "f16" else [1.0, 1 + 2**-6])


def _every_half(build_flags: list[str] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """All 65536 float16 values through the f16 kernel (W = the values, x = 1) widen exactly
    as torch widens them; `build_flags`: another build than the native one."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    weight = bits.view(torch.float16).reshape(-1, 1)
    if build_flags is not None:
        monkeypatch.setattr(gemm_bf16_kernels, "_FLAGS", build_flags)
        gemm_bf16_kernels.load.cache_clear()
    try:
        if gemm_bf16_kernels.load() is None:
            pytest.skip("no compiler for this build")
        got = gemm_bf16(torch.ones(1, 1), PackedHalfWeight(weight, "f16"), None)[0]
    finally:
        monkeypatch.undo()
        gemm_bf16_kernels.load.cache_clear()
    want = weight[:, 0].float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2 * 1023
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])  # == : the sum starts at +0, so -0 comes out +0


@pytest.mark.parametrize("march", [None, "x86-64-v3", "x86-64"])
def test_every_float16_value_widens_exactly(march: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native build's conversion, the AVX2 one's (F16C) and the portable one's (no F16C)."""
    if march is not None and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    flags = None if march is None else [f"-march={march}" if f == "-march=native" else f
                                        for f in gemm_bf16_kernels._FLAGS]
    _every_half(flags, monkeypatch)


def test_the_dot_kernel_rounds_activations_as_torch_does() -> None:
    """x's ties go to even, a NaN stays NaN, infinities and the largest finite values survive."""
    if not _cpu_has_bf16():
        pytest.skip("the dot kernel needs AVX512_BF16, which this CPU lacks")
    x = rounding_rows()
    check_rounded(x, gemm_bf16(x, PackedHalfWeight(torch.ones(1, x.shape[1]), "dot"), None)[:, 0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_thread_counts_give_identical_bits(layout: str) -> None:
    """Threads split the panels, never K: 1 and 2 threads (and more threads than panels)."""
    torch.manual_seed(2)
    nr = int(gemm_bf16_kernels._dll().gemm_bf16_nr())
    weight, x = torch.randn(5 * nr + 3, 131), torch.randn(130, 200)[:, 7:138]
    packed = PackedHalfWeight(weight, layout)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            results.append(gemm_bf16(x, packed, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    # A row's result does not depend on the other rows of its batch.
    assert torch.equal(gemm_bf16(x[64:65], packed, None), results[0][64:65])


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_the_avx2_build_gives_the_native_bits(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for x86-64-v3 (8-float vectors where an AVX-512 host's -march=native build has 16:
    other panels, another interleaving), the kernel gives the native build's bits."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 instruction set")
    torch.manual_seed(rows)
    cases = [(w, torch.randn(rows, k), torch.randn(n)) for n, k in SHAPES for w in [torch.randn(n, k)]]
    native = [gemm_bf16(x, PackedHalfWeight(w, "widen"), b) for w, x, b in cases]
    native_f16 = [gemm_bf16(x, PackedHalfWeight(w, "f16"), b) for w, x, b in cases]
    flags = ["-march=x86-64-v3" if f == "-march=native" else f for f in gemm_bf16_kernels._FLAGS]
    monkeypatch.setattr(gemm_bf16_kernels, "_FLAGS", flags)
    gemm_bf16_kernels.load.cache_clear()
    try:
        dll = gemm_bf16_kernels.load()
        if dll is None:
            pytest.skip("no compiler for the AVX2 build")
        assert int(dll.gemm_bf16_nr()) == 16
        assert not dll.gemm_bf16_dot_built() and gemm_bf16_kernels.layout() == "widen"
        for (w, x, b), want in zip(cases, native, strict=True):
            assert torch.equal(gemm_bf16(x, PackedHalfWeight(w), b), want)
        for (w, x, b), want in zip(cases, native_f16, strict=True):
            assert torch.equal(gemm_bf16(x, PackedHalfWeight(w, "f16"), b), want)
    finally:
        monkeypatch.undo()
        gemm_bf16_kernels.load.cache_clear()


def test_the_linear_kind() -> None:
    torch.manual_seed(3)
    weight, x, bias = torch.randn(96, 80), torch.randn(5, 80), torch.randn(96)
    op = PackedHalfLinear(weight)
    assert op.kind == "packed_bf16" and op.packed.kind == gemm_bf16_kernels.layout()
    assert torch.equal(op(x, bias), gemm_bf16(x, PackedHalfWeight(weight), bias))
    f16 = PackedHalfLinear(weight, torch.float16)
    assert f16.kind == "packed_f16" and f16.packed.kind == "f16" and f16.packed.unpack().dtype == torch.float16
    assert torch.equal(f16(x, bias), _float32_gemm(x, weight, bias, torch.float16))
    for w in (weight, weight.to(torch.bfloat16), weight.half()):
        assert gemm_bf16_kernels.usable(w)
    assert not gemm_bf16_kernels.usable(weight[0]) and not gemm_bf16_kernels.usable(weight.double()[0])


def test_disabled_with_the_gemm_family(monkeypatch: pytest.MonkeyPatch) -> None:
    gemm_bf16_kernels.load.cache_clear()
    monkeypatch.setenv("NORIA_DISABLE_CPU_GEMM", "1")
    try:
        assert gemm_bf16_kernels.load() is None
        assert not gemm_bf16_kernels.usable(torch.randn(4, 4))
    finally:
        monkeypatch.delenv("NORIA_DISABLE_CPU_GEMM")
        gemm_bf16_kernels.load.cache_clear()


def test_noria_cpu_march_builds_another_hosts_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """NORIA_CPU_MARCH=x86-64-v3 gives the AVX2 build (8-float vectors, no dot layout) on any x86 host."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 instruction set")
    monkeypatch.setenv("NORIA_CPU_MARCH", "x86-64-v3")
    gemm_bf16_kernels.load.cache_clear()
    try:
        dll = gemm_bf16_kernels.load()
        assert dll is not None and int(dll.gemm_bf16_nr()) == 16 and not dll.gemm_bf16_dot_built()
        assert gemm_bf16_kernels.layout() == "widen"
    finally:
        monkeypatch.delenv("NORIA_CPU_MARCH")
        gemm_bf16_kernels.load.cache_clear()
    assert int(gemm_bf16_kernels._dll().gemm_bf16_nr()) == (32 if _cpu_has_avx512() else 16)
