"""The native GEMMs over quantized weights (worker/csrc/gemm_quant.c) against float64 references
computed from the same integers: W8A8 (the int32 sums exact, so within a few float32 ulps of
float64(sum) * sx * sw + bias, and its activations quantized bit for bit as `quantize_rows`), W4A8 and
W8A8g (activations quantized per row and group bit for bit as `quantize_groups`, exact int32 sums per
group, within the float32 error of the per-group accumulation; and why per group: an outlier feature), the
weight-only W4A16 / W8A16 kernels within float32's summation error; every int8 path (AVX512_VNNI,
256-bit VNNI, AVX2, portable C) built from the same source and run in turn; and the descriptor
entries the native decoder driver calls (the decoder's gemm_fn signature), bit for bit the same."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from noria.worker import gemm_kernels, gemm_quant_groups, gemm_quant_kernels
from noria.worker.gemm_quant_groups import (
    PackedInt4Weight,
    PackedInt8GroupWeight,
    gemm_w4a8,
    gemm_w8a8g,
)
from noria.worker.gemm_quant_kernels import (
    PackedGroupWeight,
    PackedInt8Weight,
    _quantize_groups_native,
    _quantize_rows_native,
    entry,
    gemm_w8a8,
    gemm_wq,
    quantize_groups,
    quantize_rows,
)

pytestmark = pytest.mark.skipif(gemm_quant_kernels.load() is None,
                                reason="no C compiler: the native quantized GEMMs are not built")

EPS = 2.0**-24  # a float32 unit roundoff
NATIVE_FLAGS = list(gemm_quant_kernels._FLAGS)
ROWS = [1, 3, 17, 64, 130]
X86 = platform.machine() in ("x86_64", "AMD64")


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "").split()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    """x as a strided view: a column slice of a wider tensor."""
    torch.manual_seed(seed)
    return (torch.randn(rows, k + 7) * 3)[:, 5 : 5 + k]


def _int8_case(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q.view(-1)[:: max(1, q.numel() // 5)] = -128  # the extreme value on purpose
    return q, torch.rand(n) * 0.01 + 1e-4


def _w8a8_reference(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64(exact int sum) * sx * sw + bias, and the bound of a few float32 roundings of it."""
    qx, sx = quantize_rows(x)
    acc = qx.double() @ q.double().T  # integers below 2^53: exact
    scaled = acc * sx.double()[:, None] * sw.double()[None]
    b = 0 if bias is None else bias.double()
    return scaled + b, 4 * EPS * (scaled.abs() + (0 if bias is None else bias.double().abs())) + 1e-37


def _check_w8a8(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    got = gemm_w8a8(x, PackedInt8Weight(q, sw), bias)
    want, bound = _w8a8_reference(x, q, sw, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()
    return got


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(1, 4), (37, 96), (100, 259), (131, 130)])  # K not a multiple of 4 too
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_matches_float64_of_the_exact_int32_sums(rows: int, n: int, k: int, with_bias: bool) -> None:
    q, sw = _int8_case(n, k, rows * 1000 + n + k)
    x = _x(rows, k, rows + n + k)
    assert rows < 2 or not x.is_contiguous()
    bias = torch.randn(n) if with_bias else None
    got = _check_w8a8(x, q, sw, bias)
    # The worst case of the sums: every activation at +-127 against -128 weights.
    x_hot = torch.where(x >= 0, 1.0, -1.0)
    _check_w8a8(x_hot, torch.full((n, k), -128, dtype=torch.int8), sw, bias)
    # A row's result does not depend on the other rows of its batch.
    assert torch.equal(gemm_w8a8(x[-1:], PackedInt8Weight(q, sw), bias), got[-1:])


def test_w8a8_rows_of_zeros_and_non_finite_rows() -> None:
    q, sw = _int8_case(40, 64, 7)
    x = torch.randn(5, 64)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0] = float("inf")
    x[4] = 1e-44  # max / 127 underflows to 0: s = 1, q = 0
    y = gemm_w8a8(x, PackedInt8Weight(q, sw), None)
    assert torch.equal(y[1], torch.zeros(40)) and torch.equal(y[4], torch.zeros(40))
    assert y[2].isnan().all() and y[3].isnan().all()
    want, bound = _w8a8_reference(x[:1], q, sw, None)
    assert ((y[:1].double() - want).abs() <= bound).all()


def _quant_inputs() -> Iterator[torch.Tensor]:
    torch.manual_seed(11)
    yield torch.randn(33, 259) * 5
    yield torch.randn(4, 1)
    # Ties: max|x| = 127 * 2^-3, so s = 2^-3 exactly and x / s = k + 0.5 exactly (both signs, even and odd k).
    k = torch.arange(-126, 127).float()
    ties = torch.cat([(k + 0.5) * 2**-3, torch.tensor([127 * 2**-3, -127 * 2**-3])])
    yield ties[None].repeat(3, 1)
    halves = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0]])
    yield halves  # s = 1
    zeros = torch.zeros(3, 16)
    zeros[1, 4] = -0.0
    zeros[2, 5] = 3e-45  # a denormal alone: s underflows
    yield zeros
    special = torch.randn(4, 20)
    special[0, 1], special[1, 2], special[2, 3] = float("nan"), float("inf"), -float("inf")
    special[3] = torch.randn(20) * 1e-39  # denormal rows: the division is not flushed
    yield special


def test_quantize_rows_follows_the_rule() -> None:
    q, s = quantize_rows(torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0]]))
    assert s.tolist() == [1.0] and q.tolist() == [[0, 2, 2, 0, -2, -2, 126, -126, 127]]  # half to even
    q, s = quantize_rows(torch.tensor([[0.0, 0.0], [1.0, float("nan")], [-254.0, 1.0]]))
    assert s[0] == 1 and s[1].isnan() and s[2] == 2 and q.tolist() == [[0, 0], [0, 0], [-127, 0]]


@pytest.mark.parametrize("index", range(6))
def test_the_kernel_quantizes_bit_for_bit_as_quantize_rows(index: int) -> None:
    x = list(_quant_inputs())[index]
    want_q, want_s = quantize_rows(x)
    got_q, got_s = _quantize_rows_native(x.contiguous())
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_s.isnan(), want_s.isnan()) and torch.equal(got_s[~got_s.isnan()], want_s[~want_s.isnan()])


def _group_case(n: int, k: int, group: int, bits: int, zero: bool, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    q = torch.randint(lo, hi + 1, (n, k), dtype=torch.int8)
    q.view(-1)[:: max(1, q.numel() // 7)] = lo
    scale = torch.rand(n, k // group) * 0.1 + 1e-3
    z = torch.randint(lo, hi + 1, (n, k // group), dtype=torch.int8) if zero else None
    return q, scale, z


def _dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """float64 (q - zero) * scale, from the integers."""
    diff = q.double() - (0 if zero is None else zero.double().repeat_interleave(group, dim=1))
    return diff * scale.double().repeat_interleave(group, dim=1)


def _check_wq(x: torch.Tensor, w: PackedGroupWeight, q: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    got = gemm_wq(x, w, bias)
    wd = _dequantized(q, scale, zero, w.group)
    b = 0 if bias is None else bias.double()
    want = x.double() @ wd.T + b
    # Float32 sums of K products, then per group a product and a sum: ~(K + 2) roundings of the |terms|.
    bound = EPS * 2 * (x.shape[1] + 4) * (x.double().abs() @ wd.abs().T + (0 if bias is None else abs(b)))
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound + 1e-30).all()
    return got


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64, 130])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("group", "k"), [(32, 96), (64, 320), (128, 384), (None, 200)])  # odd multiples; per channel
@pytest.mark.parametrize("zero", [False, True])
def test_weight_only_matches_float64(rows: int, bits: int, group: int | None, k: int, zero: bool) -> None:
    group = group or k
    n = 133  # not a multiple of any panel width, more than 4 panels
    q, scale, z = _group_case(n, k, group, bits, zero, rows + bits + k)
    w = PackedGroupWeight(q, scale, z, group, bits)
    x = _x(rows, k, rows * 7 + k)
    bias = torch.randn(n) if rows % 2 else None
    got = _check_wq(x, w, q, scale, z, bias)
    # The decoding paths (registers, 1 / 2 / 4 panels at a time, or once per panel into scratch) give the same bits.
    assert torch.equal(gemm_wq(x[-1:], w, bias), got[-1:])
    assert torch.equal(gemm_wq(x[:2], w, bias), got[:2])


def test_weight_only_extremes() -> None:
    """Every weight at the bottom of its range against zero points at the top, and large scales."""
    for bits, lo, hi in ((4, -8, 7), (8, -128, 127)):
        q = torch.full((40, 64), lo, dtype=torch.int8)
        scale, z = torch.full((40, 2), 3e3), torch.full((40, 2), hi, dtype=torch.int8)
        x = torch.randn(9, 64)
        got = _check_wq(x, PackedGroupWeight(q, scale, z, 32, bits), q, scale, z, None)
        assert got.isfinite().all()


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_dequantizes_exactly(bits: int) -> None:
    """x = the identity: y = float32((q - zero) * scale) exactly (each group's sum is one exact term)."""
    q, scale, z = _group_case(70, 64, 32, bits, True, 5)
    w = PackedGroupWeight(q, scale, z, 32, bits)
    got = gemm_wq(torch.eye(64), w, None)
    assert torch.equal(got.T, w.dequantize())
    assert torch.equal(w.dequantize(), _dequantized(q, scale, z, 32).float())


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)


def test_thread_counts_give_identical_bits() -> None:
    """Threads split the panels (or the rows, where panels are fewer), never K: 1, 2 and 8 threads."""
    torch.manual_seed(3)
    q8, sw = _int8_case(300, 200, 1)
    q4, scale, z = _group_case(300, 256, 64, 4, True, 2)
    cases = [(lambda x: gemm_w8a8(x, PackedInt8Weight(q8, sw), None), 200),
             (lambda x: gemm_w8a8(x, PackedInt8Weight(q8[:5], sw[:5]), None), 200),  # one panel: rows split
             (lambda x: gemm_wq(x, PackedGroupWeight(q4, scale, z, 64, 4), None), 256),
             (lambda x: gemm_wq(x, PackedGroupWeight(q4[:5], scale[:5], z[:5], 64, 4), None), 256)]
    threads = torch.get_num_threads()
    try:
        for call, k in cases:
            for rows in (1, 7, 130, 300):  # 300: past the row blocks (256 int8, 192 weight-only)
                x = torch.randn(rows, k)
                results = []
                for n in (1, 2, 8):
                    _set_threads(n)
                    results.append(call(x))
                assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 259), (257, 64)])
def test_int8_unpack_round_trip(n: int, k: int) -> None:
    q, sw = _int8_case(n, k, n + k)
    w = PackedInt8Weight(q, sw)
    back_q, back_s = w.unpack()
    assert torch.equal(back_q, q) and torch.equal(back_s, sw)
    assert (w.n, w.k, w.out_features, w.in_features) == (n, k, n, k)
    padded = -(-n // int(gemm_quant_kernels._dll().gemm_quant_i8_nr())) * int(gemm_quant_kernels._dll().gemm_quant_i8_nr())
    assert w.nbytes == padded * (-(-k // 4) * 4) + padded * 8  # the panels, a scale and a correction per feature


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero", [False, True])
def test_group_unpack_round_trip_and_bytes(bits: int, zero: bool) -> None:
    n, k, group = 37, 384, 128
    q, scale, z = _group_case(n, k, group, bits, zero, bits)
    w = PackedGroupWeight(q, scale, z, group, bits)
    back_q, back_s, back_z = w.unpack()
    assert torch.equal(back_q, q) and torch.equal(back_s, scale)
    assert (back_z is None) == (z is None) and (z is None or torch.equal(back_z, z))
    assert (w.n, w.k, w.bits, w.group, w.out_features, w.in_features) == (n, k, bits, group, n, k)
    nr = int(gemm_quant_kernels._dll().gemm_quant_wq_nr())
    padded = -(-n // nr) * nr
    assert w.nbytes == padded * k * bits // 8 + padded * (k // group) * (4 + (1 if zero else 0))


def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        PackedInt8Weight(q.float(), torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        PackedInt8Weight(q, torch.ones(5))
    with pytest.raises(ValueError, match="K <="):
        PackedInt8Weight(torch.zeros(1, gemm_quant_kernels.MAX_W8A8_K + 1, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ValueError, match="divide"):
        PackedGroupWeight(q, torch.ones(4, 2), None, 48, 4)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        PackedGroupWeight(q + 8, torch.ones(4, 2), None, 32, 4)
    with pytest.raises(ValueError, match="zero points"):
        PackedGroupWeight(q, torch.ones(4, 2), torch.full((4, 2), 9, dtype=torch.int8), 32, 4)
    with pytest.raises(ValueError, match="bits"):
        PackedGroupWeight(q, torch.ones(4, 2), None, 32, 3)
    with pytest.raises(ValueError, match="scales"):
        PackedGroupWeight(q, torch.ones(4, 3), None, 32, 4)
    with pytest.raises(ValueError, match="float32"):
        gemm_w8a8(torch.zeros(2, 63), PackedInt8Weight(q, torch.ones(4)), None)
    assert gemm_w8a8(torch.zeros(0, 64), PackedInt8Weight(q, torch.ones(4)), None).shape == (0, 4)


def test_the_native_build_takes_the_cpus_int8_path() -> None:
    flags = _cpu_flags()
    want = ("avx512_vnni" if "avx512_vnni" in flags and "avx512bw" in flags else
            "avx_vnni" if "avx_vnni" in flags else "avx2" if "avx2" in flags else "portable")
    assert gemm_quant_kernels.isa() == want


# Builds of the same source: (extra flags or -march, the int8 path it takes, what the CPU needs to run it).
BUILDS = [
    pytest.param((None, None, None), id="native"),
    pytest.param((["-DQUANT_VNNI_256"], "avx_vnni", "avx512_vnni"), id="vnni256"),
    pytest.param((["-march=x86-64-v3"], "avx2", "avx2"), id="avx2"),
    pytest.param((["-march=x86-64"], "portable", None), id="portable"),
]


@pytest.fixture
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    extra, want, needs = request.param
    if extra is not None and not X86:
        pytest.skip("x86 builds")
    if needs is not None and needs not in _cpu_flags():
        pytest.skip(f"this CPU lacks {needs}")
    flags = list(gemm_quant_kernels._FLAGS)
    for f in extra or []:
        if f.startswith("-march="):
            flags[flags.index("-march=native")] = f
        else:
            flags.append(f)
    monkeypatch.setattr(gemm_quant_kernels, "_FLAGS", flags)
    gemm_quant_kernels.load.cache_clear()
    try:
        if gemm_quant_kernels.load() is None:
            pytest.skip("no compiler for this build")
        yield want or gemm_quant_kernels.isa()
    finally:
        monkeypatch.undo()
        gemm_quant_kernels.load.cache_clear()


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_every_int8_path_against_the_reference(build: str) -> None:
    assert gemm_quant_kernels.isa() == build
    for rows, (n, k) in zip([1, 17, 130], [(37, 259), (100, 64), (70, 130)], strict=True):
        q, sw = _int8_case(n, k, rows)
        x = _x(rows, k, rows)
        bias = torch.randn(n)
        _check_w8a8(x, q, sw, bias)
        _check_w8a8(torch.where(x >= 0, 1.0, -1.0), torch.full((n, k), -128, dtype=torch.int8), sw, None)
    for x in _quant_inputs():
        got_q, got_s = _quantize_rows_native(x.contiguous())
        want_q, want_s = quantize_rows(x)
        assert torch.equal(got_q, want_q) and torch.equal(got_s.nan_to_num(-1), want_s.nan_to_num(-1))


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_every_build_of_the_weight_only_kernels(build: str) -> None:
    for bits in (4, 8):
        for rows in (1, 2, 5, 40):
            q, scale, z = _group_case(75, 192, 64, bits, rows % 2 == 1, rows)
            x = _x(rows, 192, rows)
            _check_wq(x, PackedGroupWeight(q, scale, z, 64, bits), q, scale, z, torch.randn(75))


def test_builds_with_fused_multiply_adds_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-only sums are per lane, so 16-float (AVX-512) and 8-float (AVX2) panels give the same bits;
    so do the int8 paths, whose sums are exact."""
    if not X86 or "avx2" not in _cpu_flags():
        pytest.skip("needs an AVX2 host")
    torch.manual_seed(9)
    q4, scale, z = _group_case(75, 256, 128, 4, True, 9)
    q8, sw = _int8_case(75, 259, 9)
    x4, x8 = torch.randn(20, 256), torch.randn(20, 259)

    def run() -> list[torch.Tensor]:
        return [gemm_wq(x4[:m], PackedGroupWeight(q4, scale, z, 128, 4), None) for m in (1, 2, 20)] + [
            gemm_w8a8(x8, PackedInt8Weight(q8, sw), None)]

    native = run()
    monkeypatch.setenv("NORIA_CPU_MARCH", "x86-64-v3")
    gemm_quant_kernels.load.cache_clear()
    try:
        assert gemm_quant_kernels.isa() == "avx2"
        assert all(torch.equal(a, b) for a, b in zip(native, run(), strict=True))
    finally:
        monkeypatch.delenv("NORIA_CPU_MARCH")
        gemm_quant_kernels.load.cache_clear()


def test_the_avx_vnni_build_compiles() -> None:
    """The VEX-encoded AVX-VNNI code (Alder Lake and later, Zen 5) compiles; this host need not run it."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or not X86:
        pytest.skip("needs an x86 C compiler")
    flags = [f for f in gemm_quant_kernels._FLAGS if f not in ("-shared", "-march=native")]
    out = subprocess.run([cc, *flags, "-march=alderlake", "-dM", "-E", str(gemm_quant_kernels._SRC)],
                         capture_output=True, text=True)
    if out.returncode or "__AVXVNNI__" not in out.stdout:
        pytest.skip("this compiler does not know AVX-VNNI")
    asm = subprocess.run([cc, *flags, "-march=alderlake", "-S", "-o", "-", str(gemm_quant_kernels._SRC)],
                         capture_output=True, text=True, check=True).stdout
    assert "{vex} vpdpbusd" in asm or "vpdpbusd" in asm


def test_disabled_with_the_gemm_family(monkeypatch: pytest.MonkeyPatch) -> None:
    gemm_quant_kernels.load.cache_clear()
    monkeypatch.setenv("NORIA_DISABLE_CPU_GEMM", "1")
    try:
        assert gemm_quant_kernels.load() is None and not gemm_quant_kernels.usable()
    finally:
        monkeypatch.delenv("NORIA_DISABLE_CPU_GEMM")
        gemm_quant_kernels.load.cache_clear()
    assert gemm_quant_kernels.usable()


def test_weight_only_is_the_float32_gemm_where_groups_are_whole_rows() -> None:
    """Per channel, with scale 1: one group, and the sum is gemm_f32.c's in-order sum over the integers."""
    if gemm_kernels.load() is None:
        pytest.skip("the float32 native GEMM is off")
    q, _, z = _group_case(70, 96, 96, 4, True, 4)
    w = PackedGroupWeight(q, torch.ones(70, 1), z, 96, 4)
    x = torch.randn(9, 96)
    bias = torch.randn(70)
    assert torch.equal(gemm_wq(x, w, bias), gemm_kernels.gemm(x, gemm_kernels.PackedWeight(w.dequantize()), bias))



# ---------------------------------------------------------------- W4A8


def _int4_case(n: int, k: int, group: int, mode: str, seed: int) -> tuple[torch.Tensor, ...]:
    """(q, scale, zero or None, minimum or None); mode "sym", "zero" or "min" (unsigned q, float minimums)."""
    torch.manual_seed(seed)
    lo, hi = (0, 15) if mode == "min" else (-8, 7)
    q = torch.randint(lo, hi + 1, (n, k), dtype=torch.int8)
    q.view(-1)[:: max(1, q.numel() // 7)] = lo
    scale = torch.rand(n, k // group) * 0.1 + 1e-3
    zero = torch.randint(-8, 8, (n, k // group), dtype=torch.int8) if mode == "zero" else None
    minimum = torch.rand(n, k // group) * 0.5 if mode == "min" else None
    return q, scale, zero, minimum


def _w4a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    minimum: torch.Tensor | None, group: int,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 of the documented sum from the same integers, quantized activations and per-group scales, and a
    bound of its float32 roundings (per group the activation side's product and the fused multiply-add, the
    same for the minimum's, one at the end)."""
    qx, sx = quantize_groups(x, group)
    (m, k), n = x.shape, q.shape[0]
    groups = k // group
    diff = q.double() - (0 if zero is None else zero.double().repeat_interleave(group, dim=1))
    xg, wg = qx.double().view(m, groups, group), diff.view(n, groups, group)
    sxd = sx.double()[:, None, :]  # [M, 1, G]
    # exact integer sums times the activations' and the weights' group scales
    terms = torch.einsum("mgk,ngk->mng", xg, wg) * sxd * scale.double()[None]
    size = terms.abs()
    if minimum is not None:
        mins = xg.sum(2)[:, None, :] * sxd * minimum.double()[None]
        terms, size = terms - mins, size + mins.abs()
    b = 0 if bias is None else bias.double()
    want = terms.sum(2) + b
    bound = EPS * (2 * groups + 4) * size.sum(2) + 2 * EPS * abs(b) + 1e-30
    return want, bound


def _check_w4a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                minimum: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    w = PackedInt4Weight(q, scale, zero, group, minimum)
    got = gemm_w4a8(x, w, bias)
    want, bound = _w4a8_reference(x, q, scale, zero, minimum, group, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err / bound).max()
    return got


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 17, 64, 130, 300])
@pytest.mark.parametrize(("n", "k", "group"), [(37, 96, 32), (133, 320, 64), (70, 384, 128), (5, 4, 4)])
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
def test_w4a8_matches_float64_of_the_exact_group_sums(rows: int, n: int, k: int, group: int, mode: str) -> None:
    q, scale, zero, minimum = _int4_case(n, k, group, mode, rows * 31 + n + k)
    x = _x(rows, k, rows + k)
    assert rows < 2 or not x.is_contiguous()
    bias = torch.randn(n) if rows % 2 else None
    got = _check_w4a8(x, q, scale, zero, minimum, group, bias)
    # A row's result does not depend on the other rows of its batch (nor the tile it falls in).
    w = PackedInt4Weight(q, scale, zero, group, minimum)
    assert torch.equal(gemm_w4a8(x[-1:], w, bias), got[-1:])
    assert torch.equal(gemm_w4a8(x[1:6], w, bias), got[1:6])


def _group_quant_inputs() -> Iterator[tuple[torch.Tensor, int]]:
    """(x, group): random, ties, groups of zeros, denormals, NaN and infinities among finite groups."""
    torch.manual_seed(12)
    yield torch.randn(33, 256) * 5, 32
    yield torch.randn(5, 384) * torch.rand(5, 384) ** 4 * 100, 128  # spread magnitudes
    yield torch.randn(3, 8), 4
    # Ties in every group: a group's max|x| = 127 * 2^e, so s = 2^e exactly and x / s = k + 0.5 exactly.
    k = torch.arange(-126, 127).float()
    ties = torch.cat([(k + 0.5), torch.tensor([127.0, -127.0, 3.0])])  # 256 values
    yield torch.stack([ties * 2.0**e for e in (-3, 0, 5)]).view(1, -1), 256
    yield torch.cat([ties[:128] * 2**-3, torch.tensor([127 * 2**-3]), ties[129:256] * 2**-3]).view(2, 128), 64
    zeros = torch.randn(4, 64)
    zeros[0, :32] = 0  # a group of zeros beside a finite one
    zeros[1] = 0
    zeros[2, 32:] = -0.0
    zeros[3, 5] = 3e-45  # a denormal alone in a group of zeros: s underflows, so 1
    zeros[3, 6:32] = 0
    yield zeros, 32
    special = torch.randn(6, 96)
    special[0, 1] = float("nan")
    special[1, 40] = float("inf")
    special[2, 95] = -float("inf")
    special[3] = float("nan")
    special[4, 32:64] = torch.randn(32) * 1e-39  # a denormal group: the division is not flushed
    special[5, 10], special[5, 70] = float("inf"), float("nan")
    yield special, 32


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs equal."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and (
        torch.equal(a[~a.isnan()].view(torch.int32), b[~b.isnan()].view(torch.int32))
        if a.is_floating_point() else torch.equal(a, b))


def test_quantize_groups_follows_the_rule() -> None:
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, 254.0, 1.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, float("nan"), 2.0, 3.0]])
    q, s = quantize_groups(x, 4)
    assert s[0, 0] == torch.tensor(2.5) / 127 and s[0, 1:3].tolist() == [2.0, 1.0] and s[0, 3].isnan()
    assert q.tolist() == [[25, 76, 127, -25, 127, 0, -2, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    # group = K is quantize_rows; each group alone is quantize_rows of it
    x = torch.randn(7, 96)
    (q, s), (qr, sr) = quantize_groups(x, 96), quantize_rows(x)
    assert torch.equal(q, qr) and s.shape == (7, 1) and torch.equal(s[:, 0], sr)
    q, s = quantize_groups(x, 32)
    for g in range(3):
        qg, sg = quantize_rows(x[:, 32 * g : 32 * (g + 1)])
        assert torch.equal(q[:, 32 * g : 32 * (g + 1)], qg) and torch.equal(s[:, g], sg)
    with pytest.raises(ValueError, match="divide"):
        quantize_groups(x, 40)


@pytest.mark.parametrize("index", range(7))
def test_the_w4a8_kernel_quantizes_bit_for_bit_as_quantize_groups(index: int) -> None:
    x, group = list(_group_quant_inputs())[index]
    want_q, want_s = quantize_groups(x, group)
    got_q, got_s = _quantize_groups_native(x.contiguous(), group)
    assert _same(got_q, want_q) and _same(got_s, want_s)
    # a group holding a NaN or an infinity, and only it, is NaN with q = 0
    bad = ~x.view(x.shape[0], -1, group).isfinite().all(2)
    assert torch.equal(want_s.isnan(), bad) and not want_q.view(x.shape[0], -1, group)[bad].any()


def test_w4a8_an_outlier_feature_coarsens_only_its_own_group() -> None:
    """Why a scale per group: x = 1 except one feature at 100 (LLM activations' outliers). One scale per row
    (s = 100 / 127) rounds every other feature to q = 1, i.e. 0.79; per group only the outlier's group does,
    the other 7 of 8 are exact to float32. Against the float64 product of the dequantized weights and the
    float x, the error left is the outlier group's alone: for these weights about a fifth to a third (RMS
    over the outputs) of the per-row rule's error, which a torch reference of that rule gives here."""
    k, group, n, pos = 1024, 128, 256, 300
    x = torch.ones(1, k)
    x[0, pos] = 100
    own = slice(pos // group * group, (pos // group + 1) * group)
    for mode in ("sym", "zero", "min"):
        q, scale, zero, minimum = _int4_case(n, k, group, mode, 17)
        w = PackedInt4Weight(q, scale, zero, group, minimum)
        wd = w.dequantize().double()
        exact = x.double() @ wd.T
        got = gemm_w4a8(x, w, None).double()
        qr, sr = quantize_rows(x)  # the per-row rule, in float64 from its integers
        xr = qr.double() * sr.double()[:, None]
        per_row = xr @ wd.T

        def rms(t: torch.Tensor) -> float:
            return float(t.pow(2).mean().sqrt())

        err_group, err_row = rms(got - exact), rms(per_row - exact)
        assert err_row > 0.1 * rms(exact)  # the per-row rule is off by over 10%
        assert err_group < err_row / 2.5, (mode, err_group / err_row)
        # All of the per-group error is the outlier group's, where both rules quantize alike (its max is the
        # row's): the per-row rule's error over that group alone, to float32 roundings.
        own_err = (xr[:, own] - x.double()[:, own]) @ wd[:, own].T
        roundings = 64 * EPS * (x.double().abs() @ wd.abs().T)
        assert ((got - exact - own_err).abs() <= roundings).all(), mode


def test_w4a8_extremes_rows_of_zeros_and_non_finite_rows() -> None:
    """Every |q - zero| = 15 against activations at +-127 (the largest group sums), large groups too."""
    for group in (4, 128, 1024):
        q = torch.full((40, 2048), -8, dtype=torch.int8)
        zero = torch.full((40, 2048 // group), 7, dtype=torch.int8)
        x = torch.where(torch.randn(9, 2048) >= 0, 1.0, -1.0)
        got = _check_w4a8(x, q, torch.full((40, 2048 // group), 3.0), zero, None, group, torch.randn(40))
        assert got.isfinite().all()
    q, scale, zero, _ = _int4_case(40, 64, 32, "zero", 7)
    x = torch.randn(7, 64)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0] = float("inf")
    x[4] = 1e-44
    x[5, 40] = -float("inf")  # in the second group
    x[6, :32] = 0  # a group of zeros beside a finite one
    bias = torch.randn(40)
    y = gemm_w4a8(x, PackedInt4Weight(q, scale, zero, 32), bias)
    assert torch.equal(y[1], bias) and torch.equal(y[4], bias)
    assert y[2].isnan().all() and y[3].isnan().all() and y[5].isnan().all()
    want, bound = _w4a8_reference(x[[0, 6]], q, scale, zero, None, 32, bias)
    assert ((y[[0, 6]].double() - want).abs() <= bound).all()


def test_w4a8_threads_give_identical_bits() -> None:
    """Threads split the panels (or the rows, where panels are fewer), never K: 1, 2 and 8 threads."""
    cases = []
    for n in (300, 5):  # 5: one panel, so the rows are split
        for mode in ("sym", "zero", "min"):
            q, scale, zero, minimum = _int4_case(n, 256, 64, mode, n)
            cases.append(PackedInt4Weight(q, scale, zero, 64, minimum))
    threads = torch.get_num_threads()
    try:
        for w in cases:
            for rows in (1, 7, 130, 300):  # 300: past the row blocks
                x = torch.randn(rows, 256)
                results = []
                for t in (1, 2, 8):
                    _set_threads(t)
                    results.append(gemm_w4a8(x, w, None))
                assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize(("n", "k", "group"), [(1, 4, 4), (37, 384, 128), (130, 96, 32)])
def test_int4_unpack_round_trip_and_bytes(mode: str, n: int, k: int, group: int) -> None:
    q, scale, zero, minimum = _int4_case(n, k, group, mode, n + k)
    w = PackedInt4Weight(q, scale, zero, group, minimum)
    back_q, back_s, back_z, back_m = w.unpack()
    assert torch.equal(back_q, q) and torch.equal(back_s, scale)
    assert (back_z is None) == (zero is None) and (zero is None or torch.equal(back_z, zero))
    assert (back_m is None) == (minimum is None) and (minimum is None or torch.equal(back_m, minimum))
    assert (w.n, w.k, w.bits, w.group, w.out_features, w.in_features) == (n, k, 4, group, n, k)
    nr = int(gemm_quant_kernels._dll().gemm_quant_i8_nr())
    padded = -(-n // nr) * nr
    per_group = 4 + (1 if mode == "zero" else 4 if mode == "min" else 0)
    assert w.nbytes == padded * k // 2 + padded * (k // group) * per_group
    # x = the identity: y = float32 of each weight (q - zero) * scale or q * scale - minimum, within a rounding.
    want = w.dequantize().double()
    eye = gemm_w4a8(torch.eye(k) * 127, w, None).T.double() / 127
    assert ((eye - want).abs() <= 4 * EPS * (want.abs() + (0 if minimum is None else
                                                            minimum.double().abs().repeat_interleave(group, 1)))
            ).all()


def test_w4a8_bad_inputs_are_refused_with_a_clear_error() -> None:
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of 4"):
        PackedInt4Weight(q, torch.ones(4, 4), None, 18)
    with pytest.raises(ValueError, match="divide"):
        PackedInt4Weight(q, torch.ones(4, 2), None, 48)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        PackedInt4Weight(q + 8, torch.ones(4, 2), None, 32)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        PackedInt4Weight(q - 1, torch.ones(4, 2), None, 32, torch.ones(4, 2))
    with pytest.raises(ValueError, match="not both"):
        PackedInt4Weight(q, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int8), 32, torch.ones(4, 2))
    with pytest.raises(ValueError, match="zero points"):
        PackedInt4Weight(q, torch.ones(4, 2), torch.full((4, 2), 9, dtype=torch.int8), 32)
    with pytest.raises(ValueError, match="scales"):
        PackedInt4Weight(q, torch.ones(4, 3), None, 32)
    with pytest.raises(ValueError, match="minimums"):
        PackedInt4Weight(q, torch.ones(4, 2), None, 32, torch.ones(4, 3))
    with pytest.raises(ValueError, match="float32"):
        gemm_w4a8(torch.zeros(2, 63), PackedInt4Weight(q, torch.ones(4, 2), None, 32), None)
    assert gemm_w4a8(torch.zeros(0, 64), PackedInt4Weight(q, torch.ones(4, 2), None, 32), None).shape == (0, 4)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_every_build_of_w4a8_gives_the_same_bits(build: str) -> None:
    """The int32 sums are exact and the float steps are fmaf in every build, so every ISA's bits are the
    native build's (the weights packed again for each build's panels)."""
    cases = []
    for rows, mode in ((1, "sym"), (2, "zero"), (5, "min"), (40, "zero"), (13, "sym")):
        q, scale, zero, minimum = _int4_case(75, 192, 64, mode, rows)
        cases.append((_x(rows, 192, rows), q, scale, zero, minimum, torch.randn(75) if rows % 2 else None))
    got = [_check_w4a8(x, q, s, z, mi, 64, b) for x, q, s, z, mi, b in cases]
    quantized = [_quantize_groups_native(x.contiguous(), g) for x, g in _group_quant_inputs()]
    assert all(_same(a, b) for (x, g), qs in zip(_group_quant_inputs(), quantized, strict=True)
               for a, b in zip(qs, quantize_groups(x, g), strict=True))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(gemm_quant_kernels, "_FLAGS", NATIVE_FLAGS)
    try:
        gemm_quant_kernels.load.cache_clear()
        native = [gemm_w4a8(x, PackedInt4Weight(q, s, z, 64, mi), b) for x, q, s, z, mi, b in cases]
    finally:
        monkey.undo()
        gemm_quant_kernels.load.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(got, native, strict=True))


# ---------------------------------------------------------------- descriptor entries

_GEMM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


def _call_entry(w: object, x: torch.Tensor, bias: torch.Tensor | None, ldy: int, threads: int) -> torch.Tensor:
    """The decoder driver's call: entry(kind)(x, ldx, desc, bias, y, ldy, M, N, K, threads); y [M, ldy]."""
    m, n, k = x.shape[0], w.n, w.k  # type: ignore[attr-defined]
    y = torch.full((m, ldy), -7.0)
    fn = _GEMM_FN(entry(w.entry_kind))  # type: ignore[attr-defined]
    b = None if bias is None else bias.contiguous()
    fn(x.data_ptr(), x.stride(0), w.desc_ptr, None if b is None else b.data_ptr(), y.data_ptr(), ldy, m, n, k,  # type: ignore[attr-defined]
       threads)
    assert (y[:, n:] == -7).all()  # nothing written past N
    return y[:, :n]


def _weights(n: int, k: int) -> list[tuple[object, object]]:
    """(packed weight, its Python GEMM) of every kind."""
    q8, sw = _int8_case(n, k, n)
    out: list[tuple[object, object]] = [(PackedInt8Weight(q8, sw), gemm_w8a8)]
    if k % 32 == 0:
        for bits, zero in ((4, False), (4, True), (8, True)):
            q, scale, z = _group_case(n, k, 32, bits, zero, n + bits)
            out.append((PackedGroupWeight(q, scale, z, 32, bits), gemm_wq))
        for mode in ("sym", "zero", "min"):
            q, scale, z, mi = _int4_case(n, k, 32, mode, n)
            out.append((PackedInt4Weight(q, scale, z, 32, mi), gemm_w4a8))
        for mode, group in (("sym", 32), ("zero", 32), ("min", 16), ("sym", k)):
            q, scale, z, mi = _int8g_case(n, k, group, mode, n)
            out.append((PackedInt8GroupWeight(q, scale, z, group, mi), gemm_w8a8g))
    return out


@pytest.mark.parametrize(("n", "k"), [(37, 96), (300, 256), (70, 130)])
def test_descriptor_entries_match_the_python_gemms_bit_for_bit(n: int, k: int) -> None:
    threads = torch.get_num_threads()
    for w, gemm in _weights(n, k):
        for rows in (1, 2, 7, 33, 300):
            wide = torch.randn(rows, k + 19)
            x = wide[:, 3 : 3 + k]  # ldx = K + 19
            bias = torch.randn(n) if rows % 2 else None
            want = gemm(x, w, bias)
            for ldy, t in ((n, threads), (n + 5, 1), (n + 64, 3)):
                assert torch.equal(_call_entry(w, x, bias, ldy, t), want), (type(w).__name__, rows, ldy, t)


def test_descriptor_entries_from_other_threads_and_large_m() -> None:
    every = _weights(64, 128)
    (w8, g8), (w4, g4), (wg, gg) = every[0], next(c for c in every if c[1] is gemm_w4a8), every[-1]
    x = torch.randn(2500, 128)
    want = {id(w): g(x, w, None) for w, g in ((w8, g8), (w4, g4), (wg, gg))}
    errors: list[BaseException] = []

    def work(w: object) -> None:
        try:
            for _ in range(3):
                assert torch.equal(_call_entry(w, x, None, 64, 2), want[id(w)])
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    runners = [threading.Thread(target=work, args=(w,)) for w in (w8, w4, wg, w8, w4, wg)]
    for r in runners:
        r.start()
    for r in runners:
        r.join()
    assert not errors, errors


def test_descriptor_entries_with_k_zero_and_the_layout() -> None:
    w = PackedInt8Weight(torch.zeros(5, 0, dtype=torch.int8), torch.ones(5))
    bias = torch.randn(5)
    assert torch.equal(_call_entry(w, torch.zeros(3, 0), bias, 5, 1), bias.expand(3, 5))
    assert torch.equal(_call_entry(w, torch.zeros(3, 0), None, 5, 1), torch.zeros(3, 5))
    d = w.desc
    assert (d.magic, d.kind, d.n, d.k, d.layout) == (0x31445147, 1, 5, 0, int(gemm_quant_kernels._dll().gemm_quant_layout()))
    assert w.desc_ptr == ctypes.addressof(w.desc)
    kinds = ("w8a8", "wq", "w4a8", "w8a8g")
    assert len({entry(kind) for kind in kinds}) == 4 and {entry(kind) for kind in kinds} == {
        ctypes.cast(getattr(gemm_quant_kernels._dll(), f"gemm_{kind}_desc"), ctypes.c_void_p).value
        for kind in kinds}
    with pytest.raises(ValueError, match="w4a8"):
        entry("w4a16")


def test_a_descriptor_of_another_kind_is_refused_loudly() -> None:
    """An entry handed the wrong descriptor (or another build's) aborts with a message, rather than read wrong."""
    code = ("import ctypes, torch\n"
            "from noria.worker import gemm_quant_kernels as g\n"
            "w = g.PackedInt8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))\n"
            "x, y = torch.zeros(1, 8), torch.zeros(1, 4)\n"
            "f = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3"
            " + [ctypes.c_int64] * 4 + [ctypes.c_int])(g.entry('w4a8'))\n"
            "f(x.data_ptr(), 8, w.desc_ptr, None, y.data_ptr(), 4, 1, 4, 8, 1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "does not fit this entry" in out.stderr


# ---------------------------------------------------------------- W8A8g


def _int8g_case(n: int, k: int, group: int, mode: str, seed: int) -> tuple[torch.Tensor, ...]:
    """(q, scale, zero or None, minimum or None) of 8-bit weights; mode "sym", "zero" or "min" (float minimums)."""
    torch.manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q.view(-1)[:: max(1, q.numel() // 7)] = -128  # the extreme value on purpose
    scale = torch.rand(n, k // group) * 0.01 + 1e-4
    zero = torch.randint(-128, 128, (n, k // group), dtype=torch.int8) if mode == "zero" else None
    minimum = torch.rand(n, k // group) * 0.5 if mode == "min" else None
    return q, scale, zero, minimum


def _check_w8a8g(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 minimum: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Against the float64 of the documented sums (W4A8's: the same activations, sums and order)."""
    w = PackedInt8GroupWeight(q, scale, zero, group, minimum)
    got = gemm_w8a8g(x, w, bias)
    want, bound = _w4a8_reference(x, q, scale, zero, minimum, group, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err / bound).max()
    return got


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 17, 64, 130, 300])
@pytest.mark.parametrize(("n", "k", "group"), [(37, 96, 32), (133, 320, 64), (70, 384, 128), (5, 4, 4),
                                               (41, 160, 16), (29, 200, 200)])  # the last per channel
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
def test_w8a8g_matches_float64_of_the_exact_group_sums(rows: int, n: int, k: int, group: int, mode: str) -> None:
    q, scale, zero, minimum = _int8g_case(n, k, group, mode, rows * 31 + n + k)
    x = _x(rows, k, rows + k)
    assert rows < 2 or not x.is_contiguous()
    bias = torch.randn(n) if rows % 2 else None
    got = _check_w8a8g(x, q, scale, zero, minimum, group, bias)
    # A row's result does not depend on the other rows of its batch (nor the tile it falls in).
    w = PackedInt8GroupWeight(q, scale, zero, group, minimum)
    assert torch.equal(gemm_w8a8g(x[-1:], w, bias), got[-1:])
    assert torch.equal(gemm_w8a8g(x[1:6], w, bias), got[1:6])


def test_w8a8g_gguf_value_ranges() -> None:
    """Q6_K's values (-32..31, groups of 16, symmetric) and a merged Q4_K / Q6_K layer (groups of 16, Q4_K's
    rows 0..15 with minimums beside Q6_K's -32..31 with minimum 0)."""
    torch.manual_seed(21)
    n, k, group = 48, 256, 16
    q6 = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 0.01
    x = _x(9, k, 21)
    _check_w8a8g(x, q6, scale, None, None, group, None)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int8)
    merged = torch.cat([q4[:32], q6[32:]])
    minimum = torch.cat([torch.rand(32, k // group) * 0.1, torch.zeros(16, k // group)])
    _check_w8a8g(x, merged, scale, None, minimum, group, torch.randn(n))


def test_w8a8g_extremes_rows_of_zeros_and_non_finite_rows() -> None:
    """Every |q - zero| = 255 against activations at +-127 (the largest group sums), large groups too."""
    for group in (4, 128, 2048):
        q = torch.full((40, 2048), -128, dtype=torch.int8)
        zero = torch.full((40, 2048 // group), 127, dtype=torch.int8)
        x = torch.where(torch.randn(9, 2048) >= 0, 1.0, -1.0)
        got = _check_w8a8g(x, q, torch.full((40, 2048 // group), 3.0), zero, None, group, torch.randn(40))
        assert got.isfinite().all()
        _check_w8a8g(x, q, torch.full((40, 2048 // group), 3.0), None, None, group, None)
    q, scale, zero, _ = _int8g_case(40, 64, 32, "zero", 7)
    x = torch.randn(7, 64)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0] = float("inf")
    x[4] = 1e-44
    x[5, 40] = -float("inf")  # in the second group
    x[6, :32] = 0  # a group of zeros beside a finite one
    bias = torch.randn(40)
    y = gemm_w8a8g(x, PackedInt8GroupWeight(q, scale, zero, 32), bias)
    assert torch.equal(y[1], bias) and torch.equal(y[4], bias)
    assert y[2].isnan().all() and y[3].isnan().all() and y[5].isnan().all()
    want, bound = _w4a8_reference(x[[0, 6]], q, scale, zero, None, 32, bias)
    assert ((y[[0, 6]].double() - want).abs() <= bound).all()


def test_w8a8g_threads_give_identical_bits() -> None:
    """Threads split the panels (or the rows, where panels are fewer), never K: 1, 2 and 8 threads."""
    cases = []
    for n in (300, 5):  # 5: one panel, so the rows are split
        for mode in ("sym", "zero", "min"):
            q, scale, zero, minimum = _int8g_case(n, 256, 64, mode, n)
            cases.append(PackedInt8GroupWeight(q, scale, zero, 64, minimum))
    threads = torch.get_num_threads()
    try:
        for w in cases:
            for rows in (1, 7, 130, 300):  # 300: past the row blocks
                x = torch.randn(rows, 256)
                results = []
                for t in (1, 2, 8):
                    _set_threads(t)
                    results.append(gemm_w8a8g(x, w, None))
                assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize(("n", "k", "group"), [(1, 4, 4), (37, 384, 128), (130, 96, 32), (70, 64, 16)])
def test_int8_group_unpack_round_trip_and_bytes(mode: str, n: int, k: int, group: int) -> None:
    q, scale, zero, minimum = _int8g_case(n, k, group, mode, n + k)
    w = PackedInt8GroupWeight(q, scale, zero, group, minimum)
    back_q, back_s, back_z, back_m = w.unpack()
    assert torch.equal(back_q, q) and torch.equal(back_s, scale)
    assert (back_z is None) == (zero is None) and (zero is None or torch.equal(back_z, zero))
    assert (back_m is None) == (minimum is None) and (minimum is None or torch.equal(back_m, minimum))
    assert (w.n, w.k, w.bits, w.group, w.out_features, w.in_features) == (n, k, 8, group, n, k)
    nr = int(gemm_quant_kernels._dll().gemm_quant_i8_nr())
    padded = -(-n // nr) * nr
    per_group = 4 + (1 if mode == "zero" else 4 if mode == "min" else 0)
    assert w.nbytes == padded * k + padded * (k // group) * per_group
    # x = 127 * the identity: y = float32 of each weight (q - zero) * scale or q * scale - minimum, within a rounding.
    want = w.dequantize().double()
    if minimum is None:
        assert torch.equal(w.dequantize(), _dequantized(q, scale, zero, group).float())
    eye = gemm_w8a8g(torch.eye(k) * 127, w, None).T.double() / 127
    assert ((eye - want).abs() <= 4 * EPS * (want.abs() + (0 if minimum is None else
                                                            minimum.double().abs().repeat_interleave(group, 1)))
            ).all()


def test_w8a8g_bad_inputs_are_refused_with_a_clear_error() -> None:
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        PackedInt8GroupWeight(q.float(), torch.ones(4, 2), None, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        PackedInt8GroupWeight(q, torch.ones(4, 4), None, 18)
    with pytest.raises(ValueError, match="divide"):
        PackedInt8GroupWeight(q, torch.ones(4, 2), None, 48)
    with pytest.raises(ValueError, match="exact int32"):
        big = gemm_quant_groups.MAX_W8A8G_GROUP // 4 * 4 + 4
        PackedInt8GroupWeight(torch.zeros(1, big, dtype=torch.int8), torch.ones(1, 1), None, big)
    with pytest.raises(ValueError, match="not both"):
        PackedInt8GroupWeight(q, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int8), 32, torch.ones(4, 2))
    with pytest.raises(ValueError, match="zero points"):
        PackedInt8GroupWeight(q, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int16), 32)
    with pytest.raises(ValueError, match="scales"):
        PackedInt8GroupWeight(q, torch.ones(4, 3), None, 32)
    with pytest.raises(ValueError, match="minimums"):
        PackedInt8GroupWeight(q, torch.ones(4, 2), None, 32, torch.ones(4, 3))
    with pytest.raises(ValueError, match="float32"):
        gemm_w8a8g(torch.zeros(2, 63), PackedInt8GroupWeight(q, torch.ones(4, 2), None, 32), None)
    assert gemm_w8a8g(torch.zeros(0, 64), PackedInt8GroupWeight(q, torch.ones(4, 2), None, 32), None).shape == (0, 4)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_every_build_of_w8a8g_gives_the_same_bits(build: str) -> None:
    """The int32 sums are exact and the float steps are fmaf in every build, so every ISA's bits are the
    native build's (the weights packed again for each build's panels)."""
    cases = []
    for rows, mode, group in ((1, "sym", 64), (2, "zero", 16), (5, "min", 16), (40, "zero", 64), (13, "sym", 192),
                              (7, "min", 64)):
        q, scale, zero, minimum = _int8g_case(75, 192, group, mode, rows)
        cases.append((_x(rows, 192, rows), q, scale, zero, minimum, group,
                      torch.randn(75) if rows % 2 else None))
    got = [_check_w8a8g(x, q, s, z, mi, g, b) for x, q, s, z, mi, g, b in cases]
    monkey = pytest.MonkeyPatch()
    monkey.setattr(gemm_quant_kernels, "_FLAGS", NATIVE_FLAGS)
    try:
        gemm_quant_kernels.load.cache_clear()
        native = [gemm_w8a8g(x, PackedInt8GroupWeight(q, s, z, g, mi), b) for x, q, s, z, mi, g, b in cases]
    finally:
        monkey.undo()
        gemm_quant_kernels.load.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(got, native, strict=True))
