"""W8A8 and W4A8 on AMX-INT8 tiles (worker/csrc/gemm_amx.c's gemm_amx_w8a8_range and
gemm_amx_w4a8_range, given to gemm_quant.c's gemm_w8a8 and group GEMM by worker/gemm_quant_kernels.py
and worker/gemm_quant_groups.py).

The tiles compute the same exact int32 sums as vpdpbusd and the same floats of them (w8a8_out.h,
group_out.h), so every check is bit for bit against the vpdpbusd kernel (itself checked against quantize_rows' definition
in tests/test_worker_gemm_quant.py): ragged rows, features and k (a partial last k-block, one exact
block, k under a quad), a bias, a strided x, a NaN row, the split of a call's rows over threads (one
panel, more rows than panels). Each runs on the emulated build (TDPBUSD in C after the SDM's pseudo-code)
everywhere the 512-bit VNNI panels are built, and on the real tiles where the CPU has AMX-INT8.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from noria.worker import gemm_amx_kernels, gemm_quant_groups, gemm_quant_kernels, gemm_quant_tiles
from noria.worker.gemm_quant_groups import PackedInt4Weight, gemm_w4a8
from noria.worker.gemm_quant_kernels import PackedInt8Weight, gemm_w8a8


def _tiles_layout() -> bool:
    dll = gemm_quant_kernels.load()
    return bool(dll is not None and gemm_quant_kernels.isa() == "avx512_vnni" and dll.gemm_quant_i8_nr() == 64)


pytestmark = pytest.mark.skipif(
    not _tiles_layout() or gemm_amx_kernels.load(True) is None,
    reason="the tiles read the 512-bit VNNI build's W8A8 panels (AVX512_VNNI) and need a C compiler")

BUILDS = [pytest.param(True, id="emulated")] + ([pytest.param(False, id="real")] if gemm_amx_kernels.int8_ready() else [])


@pytest.fixture
def restore_tiles() -> Iterator[None]:
    before = gemm_quant_tiles.w8a8_tiles()
    yield
    assert gemm_quant_tiles.set_w8a8_tiles(*before)


def _both(x: torch.Tensor, w: PackedInt8Weight | PackedInt4Weight, bias: torch.Tensor | None,
          emulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(vpdpbusd's y, the tiles' y) for the same call, W8A8 or W4A8 by the weight's kind."""
    if isinstance(w, PackedInt4Weight):
        address, set_tiles, gemm = gemm_amx_kernels.w4a8_tiles_address(emulate), gemm_quant_groups.set_w4a8_tiles, gemm_w4a8
    else:
        address, set_tiles, gemm = gemm_amx_kernels.w8a8_tiles_address(emulate), gemm_quant_tiles.set_w8a8_tiles, gemm_w8a8
    assert address is not None
    assert set_tiles(None)
    want = gemm(x, w, bias)  # type: ignore[arg-type]
    assert set_tiles(address, 1)
    return want, gemm(x, w, bias)  # type: ignore[arg-type]


def _weight(n: int, k: int, seed: int) -> PackedInt8Weight:
    g = torch.Generator().manual_seed(seed)
    return PackedInt8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                            torch.rand(n, generator=g) / 50 + 1e-3)


# (N, K): one feature; features off 16 and 64; k under a quad, off a quad, one whole 64-k block, a
# block and a quad, several blocks and a partial one.
SHAPES = [(1, 1), (17, 3), (64, 64), (65, 63), (100, 300), (130, 257), (64, 68)]


@pytest.mark.usefixtures("restore_tiles")
@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiles_equal_vpdpbusd_bit_for_bit(emulate: bool, rows: int, n: int, k: int, with_bias: bool) -> None:
    w = _weight(n, k, rows * 1000 + n + k)
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k + 7, generator=g)[:, 3 : 3 + k] * 4  # strided rows
    bias = torch.randn(n, generator=g) if with_bias else None
    want, got = _both(x, w, bias, emulate)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


@pytest.mark.usefixtures("restore_tiles")
@pytest.mark.parametrize("emulate", BUILDS)
def test_a_non_finite_row_stays_its_own(emulate: bool) -> None:
    w = _weight(70, 130, 7)
    x = torch.randn(20, 130)
    x[3, 5], x[17, 129] = float("nan"), float("inf")
    want, got = _both(x, w, None, emulate)
    assert torch.isnan(got[[3, 17]]).all() and torch.isfinite(got[[i for i in range(20) if i not in (3, 17)]]).all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.usefixtures("restore_tiles")
@pytest.mark.parametrize("emulate", BUILDS)
def test_the_threads_split_rows_when_there_are_fewer_panels(emulate: bool) -> None:
    """One panel (N <= 64) and two threads: each thread's rows start mid-tile, and the last tile reads
    past the call's rows (into the zeroed pad rows)."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads to split the rows")
    w = _weight(40, 200, 11)
    x = torch.randn(45, 200)
    want, got = _both(x, w, torch.randn(40), emulate)
    assert torch.equal(got, want)


def test_below_the_row_threshold_calls_keep_vpdpbusd(restore_tiles: None) -> None:
    """With a threshold past the call's rows, the tiles are not called: a fake address that would crash
    if called proves it (an address of a function of another signature is never jumped to)."""
    assert gemm_quant_tiles.set_w8a8_tiles(gemm_amx_kernels.w8a8_tiles_address(True), 10**9)
    w = _weight(64, 64, 3)
    x = torch.randn(9, 64)
    got = gemm_w8a8(x, w, None)
    assert gemm_quant_tiles.set_w8a8_tiles(None)
    assert torch.equal(got, gemm_w8a8(x, w, None))


def test_load_chooses_the_tiles_where_the_cpu_has_them_unless_switched_off() -> None:
    """A fresh process picks the tiles exactly where AMX-INT8 is usable (its self-check passing, which
    the tests above make sure of) and never with NORIA_CPU_NO_AMX=1."""
    code = ("from noria.worker import gemm_quant_kernels as k, gemm_quant_tiles as q, gemm_amx_kernels as a; k.load(); "
            "print(q.w8a8_tiles()[0] is not None, a.int8_ready())")
    for no_amx in ("0", "1"):
        env = {**os.environ, "NORIA_CPU_NO_AMX": no_amx}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        chosen, ready = out.stdout.split()
        assert ready == str(gemm_amx_kernels.int8_ready())
        assert chosen == str(ready == "True" and no_amx == "0"), (no_amx, out.stdout)


# ---- W4A8 (4-bit weights, int8 activations per group) on the tiles ----

@pytest.fixture
def restore_w4a8_tiles() -> Iterator[None]:
    before = gemm_quant_groups.w4a8_tiles()
    yield
    assert gemm_quant_groups.set_w4a8_tiles(*before)


def _int4(n: int, k: int, group: int, zeros: bool, seed: int, minimums: bool = False) -> PackedInt4Weight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if minimums else (-8, 8)
    return PackedInt4Weight(torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8),
                            torch.rand(n, k // group, generator=g) / 8 + 1e-3,
                            torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8) if zeros else None,
                            group, torch.rand(n, k // group, generator=g) if minimums else None)


@pytest.mark.usefixtures("restore_w4a8_tiles")
@pytest.mark.parametrize("emulate", BUILDS)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33])
@pytest.mark.parametrize(("n", "k", "group"), [(1, 64, 64), (17, 128, 64), (64, 256, 128), (100, 384, 128),
                                               (130, 512, 256)])
@pytest.mark.parametrize("zeros", [False, True])
def test_w4a8_tiles_equal_vpdpbusd_bit_for_bit(emulate: bool, rows: int, n: int, k: int, group: int,
                                               zeros: bool) -> None:
    w = _int4(n, k, group, zeros, rows * 1000 + n + k)
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k + 5, generator=g)[:, 2 : 2 + k] * 3
    bias = torch.randn(n, generator=g) if zeros else None
    want, got = _both(x, w, bias, emulate)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


@pytest.mark.usefixtures("restore_w4a8_tiles")
@pytest.mark.parametrize("emulate", BUILDS)
def test_w4a8_a_non_finite_row_and_the_row_split(emulate: bool) -> None:
    """One panel and two threads split the rows (each thread's tiles start mid-call); a NaN row
    stays its own."""
    w = _int4(40, 256, 128, True, 5)
    x = torch.randn(45, 256)
    x[7, 200] = float("nan")
    want, got = _both(x, w, torch.randn(40), emulate)
    assert torch.isnan(got[7]).all() and torch.isfinite(got[:7]).all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.usefixtures("restore_w4a8_tiles")
@pytest.mark.parametrize(("group", "minimums"), [(32, False), (128, True)])
def test_w4a8_groups_the_tiles_do_not_take_keep_vpdpbusd(group: int, minimums: bool) -> None:
    """Groups under 64 and minimums (GGUF's Q4_0 / Q4_K) never reach the tiles: with a tile kernel
    set from one row, the answer is still vpdpbusd's (the emulated tiles would differ with minimums,
    which they do not apply)."""
    w = _int4(64, 256, group, False, 9, minimums)
    x = torch.randn(20, 256)
    want, got = _both(x, w, None, True)
    assert torch.equal(got, want)


def test_w4a8_load_chooses_the_tiles_where_the_cpu_has_them_unless_switched_off() -> None:
    code = ("import torch; from noria.worker import gemm_quant_groups as q, gemm_amx_kernels as a; "
            "q.PackedInt4Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), None, 64); "
            "print(q.w4a8_tiles()[0] is not None, a.int8_ready())")
    for no_amx in ("0", "1"):
        env = {**os.environ, "NORIA_CPU_NO_AMX": no_amx}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        chosen, ready = out.stdout.split()
        assert chosen == str(ready == "True" and no_amx == "0"), (no_amx, out.stdout)
