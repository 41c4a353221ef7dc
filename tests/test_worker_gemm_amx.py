"""The AMX-BF16 GEMM (worker/csrc/gemm_amx.c) over the dot layout's bf16 panels.

Every test runs on the emulated build (the same tiling code over tile instructions emulated in
C after the SDM's pseudo-code) and on the real build where `ready()` (a CPU with AMX-BF16 and
Linux's permission for the tile state); elsewhere the real one's test is skipped, saying why. Checked:
ragged M / N / K against a float64 reference on bf16-rounded x and W, thread-count and batch-row
invariance, tails that never leak a NaN, the emulated TDPBF16PS against a Python model of the
SDM's pseudo-code, and agreement with gemm_bf16_dot."""

from __future__ import annotations

import ctypes
import math
import struct
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from noria.worker import gemm_amx_kernels, gemm_bf16_kernels
from noria.worker.gemm_amx_kernels import gemm_amx, tile_dpbf16ps
from noria.worker.gemm_bf16_kernels import PackedHalfWeight, gemm_bf16

F32P, U16P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def _dot_layout() -> bool:
    dll = gemm_bf16_kernels.load()
    return bool(dll is not None and dll.gemm_bf16_dot_built() and dll.gemm_bf16_nr() == 32)


pytestmark = pytest.mark.skipif(
    not _dot_layout() or gemm_amx_kernels.load(True) is None,
    reason="the AMX kernel reads the dot layout with NR = 32 (AVX512_BF16) and needs a C compiler")

# The real build joins every test where the tiles are usable; elsewhere one test below stands
# skipped for it, saying why (not one skip per case).
BUILDS = [pytest.param(True, id="emulated")] + ([pytest.param(False, id="real")] if gemm_amx_kernels.ready() else [])

ROWS = [1, 5, 16, 17, 33]
# (N, K): N off multiples of 16 and 32 (but one of whole tiles), K odd, under 32, off multiples
# of 32 (one k-block plus a pair, a tail of 6 pairs after 9 blocks).
SHAPES = [(1, 1), (17, 3), (31, 31), (45, 33), (64, 64), (100, 97), (33, 300)]


def _case(rows: int, n: int, k: int, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight, x as a strided view (a column slice of a wider tensor), a bias or None."""
    torch.manual_seed(rows * 10_000 + n * 100 + k)
    weight = torch.randn(n, k)
    x = torch.randn(rows, k + 9)[:, 4 : 4 + k]
    return weight, x, torch.randn(n) if with_bias else None


def _bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result on bf16 x and W, and float32's summation error bound around it."""
    xb, wb = x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double()
    want = xb @ wb.T + (0 if bias is None else bias.double())
    k = x.shape[1]
    bound = 2.0**-23 * (k + 2) * (xb.abs() @ wb.abs().T + (0 if bias is None else bias.double().abs()))
    return want, bound


@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_on_bf16_inputs(emulate: bool, rows: int, n: int, k: int, with_bias: bool) -> None:
    weight, x, bias = _case(rows, n, k, with_bias)
    assert rows < 2 or not x.is_contiguous()
    got = gemm_amx(x, PackedHalfWeight(weight, "dot"), bias, emulate=emulate)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want, bound = _bound(x, weight, bias)
    assert ((got.double() - want).abs() <= bound).all()
    # Computed on bf16 x, not float32 x: the summation error is far below rounding x's effect.
    if k > 1:
        exact = x.double() @ weight.to(torch.bfloat16).double().T + (0 if bias is None else bias.double())
        assert (got.double() - want).norm() < 1e-2 * (exact - want).norm()


@pytest.mark.parametrize("emulate", BUILDS)
def test_thread_counts_and_batch_rows_give_identical_bits(emulate: bool) -> None:
    """Threads split the panels, never K; a row's result is the same alone as in any batch."""
    torch.manual_seed(2)
    weight, x = torch.randn(5 * 32 + 3, 131), torch.randn(130, 200)[:, 7:138]
    packed = PackedHalfWeight(weight, "dot")
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 8):
            torch.set_num_threads(t)
            results.append(gemm_amx(x, packed, None, emulate=emulate))
        torch.set_num_threads(2)
        alone = [gemm_amx(x[r : r + 1], packed, None, emulate=emulate) for r in (0, 17, 64, 129)]
        shifted = gemm_amx(x[3:40], packed, None, emulate=emulate)  # other tile rows, other padding
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    for r, row in zip((0, 17, 64, 129), alone, strict=True):
        assert torch.equal(row, results[0][r : r + 1])
    assert torch.equal(shifted, results[0][3:40])


@pytest.mark.parametrize("emulate", BUILDS)
def test_panel_ranges_give_the_whole_calls_bits(emulate: bool) -> None:
    """gemm_amx_panels (the MoE experts' entry: panels [p0, p1) on the calling thread) over ranges
    that cut the panels anywhere, each writing its columns only, gives gemm_amx's output."""
    torch.manual_seed(6)
    rows, n, k = 37, 200, 97  # 7 panels, the last ragged; odd k
    weight, x, bias = torch.randn(n, k), torch.randn(rows, k + 3)[:, 1 : 1 + k], torch.randn(n)
    packed = PackedHalfWeight(weight, "dot")
    want = gemm_amx(x, packed, bias, emulate=emulate)
    fn = gemm_amx_kernels.panels_entry(emulate)
    y = torch.full((rows, n), float("nan"))
    ptr = lambda t, kind: ctypes.cast(t.data_ptr(), kind)  # noqa: E731
    for p0, p1 in ((0, 2), (2, 3), (3, 7)):
        fn(ptr(x, F32P), x.stride(0), ptr(packed.data, U16P), ptr(bias, F32P), ptr(y, F32P), n, rows, n, k, p0, p1)
    assert torch.equal(y, want)


@pytest.mark.parametrize("emulate", BUILDS)
def test_padding_never_leaks_nan_or_inf(emulate: bool) -> None:
    """An infinite weight in the tail panel's last feature and the last (odd) k, a NaN in one row of
    x: padded rows (0 * inf = NaN there) and padded k / features are thrown away, so only the
    outputs the float64 reference makes non-finite are."""
    torch.manual_seed(4)
    rows, n, k = 17, 45, 33
    weight, x = torch.randn(n, k), torch.randn(rows, k)
    weight[n - 1, k - 1] = float("inf")
    x[9, 5] = float("nan")
    got = gemm_amx(x, PackedHalfWeight(weight, "dot"), None, emulate=emulate)
    want, bound = _bound(x, weight, None)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got.isnan().sum() == n and got.isinf().sum() == rows - 1
    finite = want.isfinite()
    assert ((got.double() - want).abs()[finite] <= bound[finite]).all()


@pytest.mark.parametrize("emulate", BUILDS)
def test_activations_round_as_torch_does(emulate: bool) -> None:
    """x's ties go to even, a NaN stays NaN, infinities and the largest finite values survive."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9), 3.0e38, -3.4e38, float("inf"), 1e-40, float("nan"), 0.1]
    x = torch.tensor(values).reshape(-1, 1)
    got = gemm_amx(x, PackedHalfWeight(torch.ones(1, 1), "dot"), None, emulate=emulate)[:, 0]
    want = x[:, 0].to(torch.bfloat16).float()
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan() & (want.abs() >= 2.0**-126)  # TDPBF16PS treats denormal inputs as zero
    assert torch.equal(got[keep], want[keep])
    assert got[6].item() == 0.0  # 1e-40 is a bf16 denormal


@pytest.mark.parametrize("emulate", BUILDS)
def test_empty_k_gives_the_bias(emulate: bool) -> None:
    bias = torch.randn(40)
    got = gemm_amx(torch.empty(3, 0), PackedHalfWeight(torch.empty(40, 0), "dot"), bias, emulate=emulate)
    assert torch.equal(got, bias.expand(3, 40))


# ---- the tile instruction against the SDM's pseudo-code ----

def _f32(v: float) -> float:
    """v as the float32 it is (the tests' values are float32 already; this checks it)."""
    r = struct.unpack("<f", struct.pack("<f", v))[0]
    assert r == v or math.isnan(v)
    return r


def _daz(v: float) -> float:
    return math.copysign(0.0, v) if v != 0 and abs(v) < 2.0**-126 else v


def _round_ftz(exact: Fraction) -> float:
    """Round to 24 significant bits (nearest even) with unbounded exponent; below 2^-126 after
    that (tiny), a zero of the exact value's sign (x86's FTZ); past float32's range, infinity."""
    sign, v = (-1.0 if exact < 0 else 1.0), abs(exact)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if v < Fraction(2) ** e:
        e -= 1
    q = round(v / Fraction(2) ** (e - 23))  # in [2^23, 2^24]; Fraction rounds half to even
    r = Fraction(q) * Fraction(2) ** (e - 23)
    if r < Fraction(2) ** -126:
        return math.copysign(0.0, sign)
    if r >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(r)


def _fma(a: float, b: float, c: float) -> float:
    """c + a * b: one float32 rounding, DAZ=FTZ=1, RNE (the SDM's "FP32 FMA")."""
    a, b, c = _daz(a), _daz(b), _daz(c)
    if not all(map(math.isfinite, (a, b, c))):
        return _f32(a * b + c)  # inf / NaN: float64 propagates them as float32 does
    product = Fraction(a) * Fraction(b)
    exact = product + Fraction(c)
    if exact == 0:
        product_sign = math.copysign(1.0, a) * math.copysign(1.0, b)
        both_negative = product == 0 and c == 0 and product_sign < 0 and math.copysign(1.0, c) < 0
        return -0.0 if both_negative else 0.0
    return _round_ftz(exact)


def _sdm_tdpbf16ps(c: list[list[float]], a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """The SDM's TDPBF16PS: per row, an even and an odd float32 accumulator per column, summed over
    the k-pairs by FMAs, then tmp = even + odd and C + tmp."""
    rows, cols, pairs = len(c), len(c[0]), len(b)
    out = []
    for m in range(rows):
        temp = [0.0] * (2 * cols)
        for k in range(pairs):
            for n in range(cols):
                temp[2 * n] = _fma(a[m][2 * k], b[k][2 * n], temp[2 * n])
                temp[2 * n + 1] = _fma(a[m][2 * k + 1], b[k][2 * n + 1], temp[2 * n + 1])
        out.append([_fma(c[m][n], 1.0, _fma(temp[2 * n], 1.0, temp[2 * n + 1])) for n in range(cols)])
    return out


def _assert_same_bits(got: torch.Tensor, want: list[list[float]]) -> None:
    want_t = torch.tensor(want, dtype=torch.float32)
    nan = want_t.isnan()
    assert torch.equal(got.isnan(), nan), (got, want_t)
    assert torch.equal(got.view(torch.int32)[~nan], want_t.view(torch.int32)[~nan]), (got, want_t)


def _run_tile(c: list[list[float]], a: list[list[float]], b: list[list[float]], emulate: bool) -> torch.Tensor:
    return tile_dpbf16ps(torch.tensor(c, dtype=torch.float32), torch.tensor(a).to(torch.bfloat16),
                         torch.tensor(b).to(torch.bfloat16), emulate=emulate)


P = 2.0  # powers of two: every value below is a bf16 exactly
HAND_CASES = {
    # Even and odd k sum apart: the SDM gives 2, one chain through C (the Intrinsics Guide's
    # pseudo-code) 1, vdpbf16ps's order (odd, then even, per pair) 0.
    "two_accumulators": ([[0.0]], [[P**24, 1.0, -(P**24), 1.0]], [[1.0, 1.0], [1.0, 1.0]], [[2.0]]),
    # A bf16 denormal input counts as zero (else 2^-120); so does a denormal in C.
    "daz_input": ([[0.0]], [[P**-130, 0.0]], [[P**10, 0.0]], [[0.0]]),
    "daz_c": ([[1e-40]], [[0.0, 0.0]], [[1.0, 1.0]], [[0.0]]),
    # A product below 2^-126 flushes to zero (else 2^-140).
    "ftz_product": ([[0.0]], [[P**-70, 0.0]], [[P**-70, 0.0]], [[0.0]]),
    # 2^-126 - 2^-150 is tiny after rounding to 24 bits: flushed (IEEE subnormal rounding would give
    # 2^-126); 2^-126 - 2^-151 rounds (ties to even) to 2^-126: kept.
    "tiny_after_rounding": ([[0.0]], [[P**-63, 0.0, P**-75, 0.0]], [[P**-63, 0.0], [-(P**-75), 0.0]], [[0.0]]),
    "not_tiny_after_rounding": ([[0.0]], [[P**-63, 0.0, P**-75, 0.0]], [[P**-63, 0.0], [-(P**-76), 0.0]],
                                [[P**-126]]),
    # inf from the even k, -inf from the odd: NaN; a NaN in C stays.
    "inf_minus_inf": ([[0.0, math.nan]], [[math.inf, 1.0]], [[1.0, -math.inf, 1.0, 1.0]], [[math.nan, math.nan]]),
    # Ties to even on the way: the even chain's 1 + 2^-24 is 1, so is even + odd (1 + 2^-24); C's
    # 2^-23 then lands exactly. Summed exactly it would be 1 + 2^-22.
    "ties_to_even": ([[P**-23]], [[1.0, P**-24, P**-24, 0.0]], [[1.0, 1.0], [1.0, 0.0]], [[1.0 + P**-23]]),
}


@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_tdpbf16ps_follows_the_sdm_pseudo_code(emulate: bool, case: str) -> None:
    c, a, b, expected = HAND_CASES[case]
    model = _sdm_tdpbf16ps(c, a, b)
    _assert_same_bits(torch.tensor(expected, dtype=torch.float32), model)  # the model's own check
    _assert_same_bits(_run_tile(c, a, b, emulate), model)


@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize(("rows", "pairs", "cols"), [(1, 1, 1), (3, 5, 4), (16, 16, 16), (7, 16, 3)])
def test_tdpbf16ps_on_random_values_and_partial_shapes(emulate: bool, rows: int, pairs: int, cols: int) -> None:
    """Tiles configured to these shapes (rows, colsb under the maximum): bit for bit the model."""
    torch.manual_seed(rows * 100 + pairs * 10 + cols)
    c = torch.randn(rows, cols)
    a = (torch.randn(rows, 2 * pairs) * 4).to(torch.bfloat16).float()
    b = torch.randn(pairs, 2 * cols).to(torch.bfloat16).float()
    model = _sdm_tdpbf16ps(c.tolist(), a.tolist(), b.tolist())
    _assert_same_bits(_run_tile(c.tolist(), a.tolist(), b.tolist(), emulate), model)


# ---- against the AVX512_BF16 dot kernel ----

AGREE_SHAPES = [(1, 1), (17, 2), (17, 3), (31, 31), (45, 33), (100, 97), (33, 300), (64, 1024)]


@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize(("n", "k"), AGREE_SHAPES)
def test_agrees_with_the_dot_kernel(emulate: bool, n: int, k: int) -> None:
    """Both are float32 sums of the same bf16 products, in other orders (vdpbf16ps: one chain per
    output; TDPBF16PS: an even and an odd chain per block of 16 pairs, then into C): within twice
    float32's summation bound of each other, and equal bit for bit while K <= 2 (one pair: both
    round even + odd once)."""
    weight, x, bias = _case(33, n, k, True)
    packed = PackedHalfWeight(weight, "dot")
    amx, dot = gemm_amx(x, packed, bias, emulate=emulate), gemm_bf16(x, packed, bias)
    _, bound = _bound(x, weight, bias)
    assert ((amx.double() - dot.double()).abs() <= 2 * bound).all()
    if k <= 2:
        assert torch.equal(amx, dot)
    print(f"N={n} K={k}: {(amx == dot).double().mean().item():.1%} of outputs bit-identical to gemm_bf16_dot")


@pytest.mark.skipif(not gemm_amx_kernels.ready(),
                    reason=f"no usable AMX on this host ({gemm_amx_kernels.not_ready_reason()}): the real tile "
                           "instructions can't run here (every test above runs them where they can)")
def test_the_real_tiles_agree_with_the_emulation() -> None:
    """Within float32's summation bound: the silicon's internal order need not be the SDM's."""
    weight, x, bias = _case(33, 100, 300, True)
    packed = PackedHalfWeight(weight, "dot")
    _, bound = _bound(x, weight, bias)
    real, emulated = gemm_amx(x, packed, bias, emulate=False), gemm_amx(x, packed, bias, emulate=True)
    assert ((real.double() - emulated.double()).abs() <= 2 * bound).all()


# ---- the builds and the readiness check ----

def test_ready_agrees_with_proc_cpuinfo() -> None:
    """ready() where the CPU lists amx_bf16 and amx_tile (Linux grants the tile state on those);
    on a CPU without them (AMD Zen 4, say), not ready, and the reason names the CPU."""
    has_amx = {"amx_bf16", "amx_tile"} <= _cpu_flags()
    assert gemm_amx_kernels.ready() == has_amx, gemm_amx_kernels.not_ready_reason()
    if not has_amx and gemm_amx_kernels.load(False) is not None:
        assert "CPU has no AMX" in gemm_amx_kernels.not_ready_reason()


def test_the_two_builds() -> None:
    emulated = gemm_amx_kernels.load(True)
    assert emulated.gemm_amx_emulated() == 1 and emulated.gemm_amx_built() == 0
    real = gemm_amx_kernels.load(False)
    if real is None:
        pytest.skip("the compiler can't build with -mamx-tile -mamx-bf16")
    assert real.gemm_amx_emulated() == 0 and real.gemm_amx_built() == 1


@pytest.mark.skipif(gemm_amx_kernels.ready(), reason="checks the guard where AMX is not usable")
def test_the_real_build_refuses_instead_of_faulting_where_amx_is_not_usable() -> None:
    """No SIGILL on a host without AMX: the tile test hook says so, gemm_amx aborts with a message."""
    real = gemm_amx_kernels.load(False)
    if real is None:
        pytest.skip("the compiler can't build with -mamx-tile -mamx-bf16")
    one = torch.zeros(1, dtype=torch.float32)
    bits = torch.zeros(2, dtype=torch.int16)
    f32p, u16p = gemm_amx_kernels._F32P, gemm_amx_kernels._U16P
    rc = real.gemm_amx_tile_dp(gemm_amx_kernels._ptr(one, f32p), gemm_amx_kernels._ptr(bits, u16p),
                               gemm_amx_kernels._ptr(bits, u16p), gemm_amx_kernels._ptr(one, f32p), 1, 1, 1)
    assert rc == -2
    script = ("import torch\nfrom noria.worker import gemm_amx_kernels as g\n"
              "w = g.PackedHalfWeight(torch.ones(3, 3), 'dot')\n"
              "g._dll = lambda emulate, checked=False: g.load(False)\n"  # past the Python-side assertion
              "g.gemm_amx(torch.ones(2, 3), w, None)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -6, (proc.returncode, proc.stderr[-2000:])  # SIGABRT, not SIGILL (-4)
    assert "gemm_amx: AMX is not usable here" in proc.stderr


@pytest.mark.parametrize("tiles_right", [True, False])
def test_the_self_check_keeps_wrong_tiles_off(tiles_right: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles that the OS grants but that compute other numbers than the emulation are not used:
    the "real" tiles here are the emulated ones, shifted where the test wants them wrong."""
    emulated = gemm_amx_kernels.gemm_amx

    def tiles(x: torch.Tensor, w: PackedHalfWeight, bias: torch.Tensor | None, emulate: bool = False,
              before_check: bool = False) -> torch.Tensor:
        out = emulated(x, w, bias, emulate=True)
        return out if emulate or tiles_right else out + 1e-3 * out.abs().max()

    monkeypatch.setattr(gemm_amx_kernels, "_tiles_usable", lambda: True)
    monkeypatch.setattr(gemm_amx_kernels, "gemm_amx", tiles)
    gemm_amx_kernels.self_check.cache_clear()
    try:
        if tiles_right:
            assert gemm_amx_kernels.self_check() is None and gemm_amx_kernels.ready()
            assert gemm_bf16_kernels.layout() == "amx"
        else:
            assert gemm_amx_kernels.self_check().startswith("the AMX tiles' self-check exceeded")
            assert not gemm_amx_kernels.ready() and gemm_bf16_kernels.layout() == "dot"
    finally:
        gemm_amx_kernels.self_check.cache_clear()
