"""The emulator's tensor-core and async-copy instructions (kernels/csrc/tensor_core.cuh over
kernels/emu/include/cudaemu/tensor_core.h): mma and ldmatrix against fragment layouts written
out here from the PTX ISA's tables, cp.async groups against the data, the checker's reports
(reads before the covering wait, divergent warps, bad ldmatrix addresses), two mutants that
the tests must catch, and the same probe kernels compiled by NVRTC for sm_80 and sm_90."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from noria.kernels import nvrtc_check
from noria.kernels.emu import EmuKernelError, EmuRawModule, build, wrapper
from noria.kernels.options import ARCHS, PTXAS_VERBOSE, compile_options

PROBES = Path(__file__).with_name("tensor_core_probe_kernels.cu")
ORDERS = ("forward", "greedy", "greedy-reverse", "random:7")


@functools.cache
def _module(code: str | None = None, include: Path | None = None) -> EmuRawModule:
    saved = build.EMU_INCLUDE
    if include is not None:  # a mutated copy of the emulator's headers
        build.EMU_INCLUDE = include
    try:
        module = EmuRawModule(
            code=code if code is not None else PROBES.read_text(),
            options=compile_options(),
            source_name=PROBES.name,
        )
        module.compile()
    finally:
        build.EMU_INCLUDE = saved
    return module


def probes(schedule: str = "forward", memcheck: bool = True, **kw: object) -> EmuRawModule:
    return _module(**kw).with_config(schedule=schedule, workers=1, memcheck=memcheck)  # type: ignore[arg-type]


# ---- the PTX ISA's fragment tables, element by element (groupID g, threadID_in_group t) ----


def _a_coords(lane: int, k: int) -> list[tuple[int, int]]:
    """(row, col) of a0, a1, ... for one lane; a_{2j}, a_{2j+1} share register j."""
    g, t = lane // 4, lane % 4
    out = []
    for i in range(k // 2):
        row = g if i in (0, 1, 4, 5) else g + 8
        col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
        out.append((row, col))
    return out


def _b_coords(lane: int, k: int) -> list[tuple[int, int]]:
    g, t = lane // 4, lane % 4
    return [(2 * t + (i & 1) + (8 if i >= 2 else 0), g) for i in range(k // 4)]


def _c_coords(lane: int) -> list[tuple[int, int]]:
    g, t = lane // 4, lane % 4
    return [(g if i < 2 else g + 8, 2 * t + (i & 1)) for i in range(4)]


def _pack(bits: np.ndarray, coords: list[tuple[int, int]]) -> list[int]:
    """Pairs of 16-bit elements into registers, the first of each pair in the low half."""
    vals = [int(bits[r, c]) for r, c in coords]
    return [vals[j] | (vals[j + 1] << 16) for j in range(0, len(vals), 2)]


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16)


def _random_operands(k: int, dtype: torch.dtype, warps: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(warps, 16, k, generator=g).to(dtype)
    b = torch.randn(warps, k, 8, generator=g).to(dtype)
    c = torch.randn(warps, 16, 8, generator=g)
    return a, b, c


@pytest.mark.parametrize("k", [16, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_mma_matches_a_float64_product_fragment_by_fragment(k: int, dtype: torch.dtype) -> None:
    warps = 3
    a, b, c = _random_operands(k, dtype, warps, seed=k)
    a_regs = np.zeros((warps, 32, k // 4), np.uint32)
    b_regs = np.zeros((warps, 32, k // 8), np.uint32)
    c_regs = np.zeros((warps, 32, 4), np.float32)
    for w in range(warps):
        abits, bbits = _bits(a[w]), _bits(b[w])
        for lane in range(32):
            a_regs[w, lane] = _pack(abits, _a_coords(lane, k))
            b_regs[w, lane] = _pack(bbits, _b_coords(lane, k))
            c_regs[w, lane] = [float(c[w, r, col]) for r, col in _c_coords(lane)]
    d_regs = np.full((warps, 32, 4), np.nan, np.float32)
    name = "mma_k16" if k == 16 else "mma_k8"
    probes().get_function(name)(
        warps, 32, (a_regs, b_regs, c_regs, d_regs, np.int32(dtype == torch.bfloat16))
    )
    expected = a.double() @ b.double() + c.double()
    for w in range(warps):
        for lane in range(32):
            want = [float(expected[w, r, col]) for r, col in _c_coords(lane)]
            np.testing.assert_allclose(d_regs[w, lane], want, rtol=2e-7, atol=1e-30)


def test_mma_catches_each_misplaced_register() -> None:
    """Swapping any two of a lane's A registers changes D: the check above is sensitive to
    the register order, not only to the set of values."""
    a, b, c = _random_operands(16, torch.bfloat16, 1, seed=5)
    abits, bbits = _bits(a[0]), _bits(b[0])
    a_regs = np.array([_pack(abits, _a_coords(lane, 16)) for lane in range(32)], np.uint32)
    b_regs = np.array([_pack(bbits, _b_coords(lane, 16)) for lane in range(32)], np.uint32)
    c_regs = np.zeros((32, 4), np.float32)
    d = np.zeros((32, 4), np.float32)
    kern = probes().get_function("mma_k16")
    kern(1, 32, (a_regs, b_regs, c_regs, d, np.int32(1)))
    right = d.copy()
    swapped = a_regs.copy()
    swapped[:, [1, 2]] = swapped[:, [2, 1]]
    kern(1, 32, (swapped, b_regs, c_regs, d, np.int32(1)))
    assert not np.allclose(d, right)


def _ldmatrix_expected(
    tile: np.ndarray, row_of_lane: np.ndarray, num: int, trans: bool
) -> np.ndarray:
    out = np.zeros((32, 4), np.uint32)
    for j in range(num):
        m = tile[row_of_lane[8 * j : 8 * j + 8]]  # matrix j: rows from lanes 8j .. 8j+7
        if trans:
            m = m.T
        for lane in range(32):
            g, t = lane // 4, lane % 4
            out[lane, j] = int(m[g, 2 * t]) | (int(m[g, 2 * t + 1]) << 16)
    return out


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_gives_each_lane_its_fragment(num: int, trans: bool) -> None:
    rng = np.random.default_rng(num + 10 * trans)
    tile = rng.integers(0, 65536, (32, 8)).astype(np.uint16)
    row_of_lane = rng.permutation(32).astype(np.int32)  # addresses come from the lanes
    out = np.zeros((32, 4), np.uint32)
    probes().get_function("ldmatrix_probe")(
        1, 32, (tile, row_of_lane, out, np.int32(num), np.int32(trans))
    )
    assert np.array_equal(out, _ldmatrix_expected(tile, row_of_lane, num, trans))


@pytest.mark.parametrize("schedule", ORDERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_cp_async_ldmatrix_mma_tile(dtype: torch.dtype, schedule: str) -> None:
    """The three together as a kernel uses them: ldmatrix.x4 of a row-major tile is an A
    fragment, ldmatrix.x2.trans of a row-major B is a B fragment."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    d = np.full((16, 8), np.nan, np.float32)
    name = "tile_gemm_bf16" if dtype == torch.bfloat16 else "tile_gemm_f16"
    probes(schedule).get_function(name)(1, 32, (_bits(a), _bits(b), d))
    np.testing.assert_allclose(d, (a.double() @ b.double()).numpy(), rtol=2e-7, atol=1e-6)


def _cp_async_expected(src: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, 12), np.float32)
    for t in range(n):
        u = (t + 1) % n
        out[t, :4] = src[4 * t : 4 * t + 4]
        out[t, 4:6] = src[512 + 2 * u : 512 + 2 * u + 2]
        out[t, 6] = src[768 + u]
        keep = u % 5  # floats read; the rest of the 16 bytes is zero-filled
        out[t, 8 : 8 + keep] = src[4 * u : 4 * u + keep]
    return out


@pytest.mark.parametrize("schedule", ORDERS)
def test_cp_async_groups_land_by_their_waits(schedule: str) -> None:
    src = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    out = np.full((128, 12), np.nan, np.float32)
    probes(schedule).get_function("cp_async_groups")(1, 128, (src, out))
    assert np.array_equal(out, _cp_async_expected(src, 128))
    out4 = np.full(512, np.nan, np.float32)
    probes(schedule).get_function("cp_async_wait_all_probe")(1, 128, (src, out4))
    assert np.array_equal(out4, src[:512])


# ---- what the checker reports ----


def _without(text: str, line: str) -> str:
    assert text.count(line) == 1, line
    return text.replace(line, "")


MISSING_WAIT = "  noria::cp_async_wait<1>();\n"


def test_read_before_the_covering_wait_is_reported() -> None:
    """cp_async_groups without its cp_async_wait<1>: the thread reads group 0's bytes while
    they are in flight. With the check off the copy has not landed: the read sees the
    unwritten (NaN) shared memory."""
    code = _without(PROBES.read_text(), MISSING_WAIT)
    src = np.ones(1024, np.float32)
    out = np.zeros((128, 12), np.float32)
    with pytest.raises(
        EmuKernelError,
        match=r"thread \(0,0,0\): shared memory read of 4 bytes \(variable cp_async_groups::a_s, "
        r"byte offset 0\) while this thread's cp.async to it is in flight: group 0 of thread \(0,0,0\) "
        r"is not covered by a cp.async.wait_group",
    ):
        probes(code=code).get_function("cp_async_groups")(1, 128, (src, out))
    probes(code=code, memcheck=False).get_function("cp_async_groups")(1, 128, (src, out))
    assert np.isnan(out[:, :4]).all()


def test_read_of_another_threads_copy_before_its_wait_is_reported() -> None:
    """tile_gemm without its wait: ldmatrix reads rows that other lanes' cp.async have in
    flight (and, with the check off, reads unwritten shared memory)."""
    text = PROBES.read_text()
    wait = "  noria::cp_async_commit();\n  noria::cp_async_wait<0>();\n  __syncthreads();\n"
    assert text.count(wait) == 1
    code = text.replace(wait, "  noria::cp_async_commit();\n  __syncthreads();\n")
    a = np.zeros(256, np.uint16)
    d = np.zeros((16, 8), np.float32)
    with pytest.raises(
        EmuKernelError,
        match=r"shared memory read of 16 bytes \(variable a_s \(in tile_gemm<__nv_bfloat16>\), byte "
        r"offset \d+\) while .* cp.async to it is in flight",
    ):
        probes(code=code).get_function("tile_gemm_bf16")(1, 32, (a, a[:128], d))
    probes(code=code, memcheck=False).get_function("tile_gemm_bf16")(1, 32, (a, a[:128], d))
    assert np.isnan(d).all()


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (
            "mma_after_partial_exit",
            r"returned while lanes 0x0000ffff of its warp wait for it in mma.sync",
        ),
        (
            "mma_in_divergent_branches",
            r"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 at different places",
        ),
        ("mma_meets_ldmatrix", r"meet in different collectives: .*(ldmatrix|mma)"),
    ],
)
def test_divergent_warps_are_reported(kernel: str, message: str) -> None:
    out = np.zeros(32, np.float32)
    with pytest.raises(EmuKernelError, match=message):
        probes().get_function(kernel)(1, 32, (out,))


def test_mma_needs_a_whole_warp() -> None:
    a, b = np.zeros((48, 4), np.uint32), np.zeros((48, 2), np.uint32)
    c, d = np.zeros((48, 4), np.float32), np.zeros((48, 4), np.float32)
    with pytest.raises(
        EmuKernelError, match=r"thread \(32,0,0\): mma.sync.* names lanes that do not exist"
    ):
        probes().get_function("mma_k16")(1, 48, (a, b, c, d, np.int32(1)))


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0, r"lane 0's row address .* is not shared memory"),
        (
            1,
            r"thread \(7,0,0\): out-of-bounds shared memory read of 16 bytes: variable ldmatrix_bad_address::s",
        ),
        (2, r"lane 0's row address .* is not 16-byte aligned"),
    ],
)
def test_bad_ldmatrix_addresses_are_reported(mode: int, message: str) -> None:
    g = np.zeros(64, np.uint16)
    out = np.zeros(32, np.uint32)
    with pytest.raises(EmuKernelError, match=message):
        probes().get_function("ldmatrix_bad_address")(1, 32, (g, out, np.int32(mode)))


# ---- mutants: a wrong lane mapping in the emulator, a missing wait in a kernel ----

A_GATHER = "const unsigned row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);"
A_GATHER_SWAPPED = "const unsigned row = g + 8 * (i >> 1), col = 2 * t + 8 * (i & 1);"


def _mutated_emulator(tmp: Path, old: str, new: str) -> Path:
    include = tmp / "include"
    shutil.copytree(build.EMU_INCLUDE, include)
    header = include / "cudaemu" / "tensor_core.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    return include


def test_mutant_a_fragment_rows_swapped_is_caught(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The emulator gathers A's registers 1 and 2 in each other's place (the rows g + 8 and the
    columns + 8 confused): the fragment test must fail, as must the ldmatrix + mma tile."""
    include = _mutated_emulator(tmp_path_factory.mktemp("mutant"), A_GATHER, A_GATHER_SWAPPED)
    a, b, c = _random_operands(16, torch.bfloat16, 1, seed=1)
    abits, bbits = _bits(a[0]), _bits(b[0])
    a_regs = np.array([_pack(abits, _a_coords(lane, 16)) for lane in range(32)], np.uint32)
    b_regs = np.array([_pack(bbits, _b_coords(lane, 16)) for lane in range(32)], np.uint32)
    c_regs = np.zeros((32, 4), np.float32)
    d = np.zeros((32, 4), np.float32)
    probes(include=include).get_function("mma_k16")(1, 32, (a_regs, b_regs, c_regs, d, np.int32(1)))
    expected = (a[0].double() @ b[0].double()).numpy()
    want = np.array([[expected[r, col] for r, col in _c_coords(lane)] for lane in range(32)])
    assert not np.allclose(d, want, rtol=1e-5, atol=1e-5)
    tile = np.full((16, 8), np.nan, np.float32)
    probes(include=include).get_function("tile_gemm_bf16")(
        1, 32, (abits.ravel(), bbits.ravel(), tile)
    )
    assert not np.allclose(tile, expected, rtol=1e-5, atol=1e-5)


def test_mutant_missing_wait_group_is_caught() -> None:
    """The cp_async_groups test kernel without its cp_async_wait<1>: the data test fails under
    every thread order (the checker reports the read) and, unchecked, gets NaN."""
    code = _without(PROBES.read_text(), MISSING_WAIT)
    src = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    for schedule in ORDERS:
        out = np.full((128, 12), np.nan, np.float32)
        with pytest.raises(EmuKernelError, match="in flight"):
            probes(schedule, code=code).get_function("cp_async_groups")(1, 128, (src, out))
        probes(schedule, code=code, memcheck=False).get_function("cp_async_groups")(
            1, 128, (src, out)
        )
        assert not np.array_equal(out, _cp_async_expected(src, 128))


# ---- the same kernels through NVRTC ----


@pytest.mark.parametrize("arch", ARCHS)
def test_probe_kernels_compile_with_nvrtc(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tensor_core.cuh's inline PTX is valid for sm_80 and sm_90: NVRTC and ptxas (inside
    NVRTC) compile every probe kernel through RawModule's own call."""
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    options = compile_options() + PTXAS_VERBOSE
    with nvrtc_check.offline_nvrtc(arch) as calls:
        log = nvrtc_check.rawmodule_compile(PROBES.read_text(), options, [])
    assert len(calls) == 1 and calls[0]["binary"] > 0
    compiled = set(nvrtc_check._ENTRY.findall(log))
    kernels = wrapper.extern_c_kernels(PROBES.read_text())
    assert len(kernels) == 11
    for kernel in kernels:
        assert (kernel, arch) in compiled, (kernel, sorted(compiled))
