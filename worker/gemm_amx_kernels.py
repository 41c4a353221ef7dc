"""The AMX-BF16 GEMM over bfloat16 weights (worker/csrc/gemm_amx.c), for Sapphire Rapids and later,
and the AMX-INT8 tiles that worker/gemm_quant_kernels.py gives its W8A8 GEMM (`w8a8_tiles_address`).

It multiplies the same packed panels as gemm_bf16_kernels' "dot" kernel (the "amx" layout is
the dot layout, NR = 32), 16 x 16 float32 tiles at a time; gemm_bf16_kernels.layout() picks
it where `ready()`. The C file is built twice through
worker/native_build.py:

- the real build, with the AMX intrinsics (-mamx-tile -mamx-bf16), which runs only where
  `ready()`: the CPU has AMX-BF16 and Linux granted this process the tile data state;
- the emulated build (-DNORIA_AMX_EMULATE): the same tiling code over tile instructions
  emulated in C after the SDM's pseudo-code, which runs anywhere; it is what the tests check
  on hosts without AMX.

Only valid where gemm_bf16_kernels builds the dot layout (AVX512_BF16, NR = 32).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker import gemm_bf16_kernels
from noria.worker.cpu_ops import disabled
from noria.worker.gemm_bf16_kernels import PackedHalfWeight
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "gemm_amx.c"
# No -ffast-math: every output is one in-order sum over its k-blocks (see the C file).
_FLAGS = ["-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-fopenmp", "-shared", "-fPIC"]
_EMULATE_FLAGS = ["-O3", "-march=native", "-DNORIA_AMX_EMULATE", "-fopenmp", "-shared", "-fPIC"]
_I64, _INT = ctypes.c_int64, ctypes.c_int
_F32P, _U16P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16)
NR = 32  # the panel width the tiles assume: two 16-feature B tiles per pair-row


@cache
def load(emulate: bool) -> ctypes.CDLL | None:
    """The real (emulate=False) or emulated build, or None where it can't be built or the gemm
    family is on torch."""
    if disabled("gemm"):
        return None
    dll = build(_SRC, _EMULATE_FLAGS if emulate else _FLAGS)
    if dll is None:
        return None
    for name in ("gemm_amx_built", "gemm_amx_emulated", "gemm_amx_ready"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [], _INT
    dll.gemm_amx_ready_reason.argtypes, dll.gemm_amx_ready_reason.restype = [], ctypes.c_char_p
    dll.gemm_amx.argtypes = [_F32P, _I64, _U16P, _F32P, _F32P, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_amx.restype = None
    dll.gemm_amx_tile_dp.argtypes = [_F32P, _U16P, _U16P, _F32P, _INT, _INT, _INT]
    dll.gemm_amx_tile_dp.restype = _INT
    dll.gemm_amx_int8_ready.argtypes, dll.gemm_amx_int8_ready.restype = [], _INT
    dll.gemm_amx_panels.argtypes = [_F32P, _I64, _U16P, _F32P, _F32P, _I64, _I64, _I64, _I64, _I64, _I64]
    dll.gemm_amx_panels.restype = None
    return dll


def int8_ready() -> bool:
    """The real build is built, and the CPU has AMX-INT8 with the tile state granted."""
    return _tiles_usable() and bool(load(False).gemm_amx_int8_ready())  # type: ignore[union-attr]


def w8a8_tiles_address(emulate: bool) -> int | None:
    """The address of gemm_amx_w8a8_range (gemm_quant.c's W8A8 product on AMX-INT8 tiles) in the
    emulated build, or in the real one where `int8_ready()`; else None."""
    return _int8_address("gemm_amx_w8a8_range", emulate)


def w4a8_tiles_address(emulate: bool) -> int | None:
    """The address of gemm_amx_w4a8_range (gemm_quant.c's W4A8 product on AMX-INT8 tiles), as
    `w8a8_tiles_address`."""
    return _int8_address("gemm_amx_w4a8_range", emulate)


def _int8_address(name: str, emulate: bool) -> int | None:
    dll = load(emulate)
    if dll is None or (not emulate and not int8_ready()):
        return None
    return ctypes.cast(getattr(dll, name), ctypes.c_void_p).value


def _tiles_usable() -> bool:
    dll = load(False)
    return bool(dll is not None and dll.gemm_amx_built() and dll.gemm_amx_ready())


def ready() -> bool:
    """The real build is built, the CPU has AMX-BF16, Linux granted the tile data state, and the
    real tiles passed `self_check()`."""
    return _tiles_usable() and self_check() is None


def not_ready_reason() -> str:
    """Why `ready()` is False ("ready" when it is True)."""
    dll = load(False)
    if dll is None:
        return "the AMX build failed (no C compiler, or one without -mamx-tile)"
    if not dll.gemm_amx_built():
        return "built without the AMX intrinsics"
    if not dll.gemm_amx_ready():
        return dll.gemm_amx_ready_reason().decode()
    return self_check() or "ready"


@cache
def self_check() -> str | None:
    """None where the real tiles compute a ragged product (every tail: rows, features and k off
    the tile sizes) as the emulation does, within float32's summation bound; else what differed.
    The real tile path is first run on the host that has it, so its first use checks it, and a
    disagreement leaves the worker on the dot kernel instead of on wrong numbers."""
    if not _tiles_usable():
        return None
    g = torch.Generator().manual_seed(0)
    weight, x, bias = torch.randn(100, 300, generator=g), torch.randn(33, 300, generator=g), torch.randn(100, generator=g)
    packed = PackedHalfWeight(weight, "dot")
    real, emulated = (gemm_amx(x, packed, bias, emulate=e, before_check=True) for e in (False, True))
    xb, wb = x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double()
    bound = 2.0**-22 * (x.shape[1] + 2) * (xb.abs() @ wb.abs().T + bias.double().abs())
    worst = float(((real.double() - emulated.double()).abs() - bound).max())
    return None if worst <= 0 else f"the AMX tiles' self-check exceeded float32's error bound by {worst:.3g}"


def entry(emulate: bool = False) -> ctypes._CFuncPtr:
    """gemm_amx of the real build (where `ready()`) or the emulated one: gemm_f32's arguments."""
    return _dll(emulate).gemm_amx


def panels_entry(emulate: bool = False) -> ctypes._CFuncPtr:
    """gemm_amx_panels (gemm_bf16_dot_panels' arguments: panels [p0, p1) on the calling thread) of
    the real build (where `ready()`) or the emulated one: the MoE experts' one native call."""
    return _dll(emulate).gemm_amx_panels


def _dll(emulate: bool, checked: bool = False) -> ctypes.CDLL:
    dll = load(emulate)
    assert dll is not None, f"the {'emulated ' if emulate else ''}AMX GEMM is not built"
    if not emulate:
        assert (_tiles_usable() if checked else ready()), f"AMX is not usable here: {not_ready_reason()}"
    return dll


def _dot_layout_assert(w: PackedHalfWeight) -> None:
    bf16 = gemm_bf16_kernels._dll()
    assert bf16.gemm_bf16_dot_built() and int(bf16.gemm_bf16_nr()) == NR, \
        "the AMX GEMM needs the dot layout with NR = 32 (an AVX512_BF16 host)"
    assert w.kind in ("dot", "amx") and w.data.shape[-1] == NR, (w.kind, tuple(w.data.shape))


def _ptr(t: torch.Tensor, kind: type) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), kind)


def gemm_amx(x: torch.Tensor, w: PackedHalfWeight, bias: torch.Tensor | None,
             emulate: bool = False, before_check: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias): [M, N] float32, on AMX tiles (or their emulation). x float32 on
    the CPU, any row stride; `w` a PackedHalfWeight(weight, kind="dot"). `before_check`: the real
    tiles before `self_check()` has passed (it runs them)."""
    dll = _dll(emulate, before_check)
    _dot_layout_assert(w)
    return gemm_bf16_kernels.gemm_bf16(x, w, bias, dll.gemm_amx)


def tile_dpbf16ps(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """One TDPBF16PS through the kernel's tile macros: c [rows, cols] float32 plus a [rows, 2 *
    pairs] bf16 times b [pairs, 2 * cols] bf16 (VNNI: b[k, 2n + i] is W's k-pair element i of
    column n), as the tiles (or their emulation) compute it. Shapes 1..16 each."""
    dll = _dll(emulate)
    rows, cols = c.shape
    pairs = a.shape[1] // 2
    assert c.dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
    assert a.shape == (rows, 2 * pairs) and b.shape == (pairs, 2 * cols), (a.shape, b.shape)
    c, out = c.contiguous(), torch.empty(rows, cols, dtype=torch.float32)
    a, b = a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)
    rc = dll.gemm_amx_tile_dp(_ptr(c, _F32P), _ptr(a, _U16P), _ptr(b, _U16P), _ptr(out, _F32P), rows, pairs, cols)
    assert rc == 0, f"gemm_amx_tile_dp: {rc}"
    return out
