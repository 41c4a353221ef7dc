"""The native GEMM over 16-bit weights for the CPU linear layers (worker/csrc/gemm_bf16.c).

x and y are float32 and W is kept in 16-bit panels (half the bytes a decode step reads). A
bfloat16 W takes one of two layouts, the kernel's `layout()`:

- "dot" where the CPU has AVX512_BF16: x rounded to bf16 and multiplied in pairs of k by
  vdpbf16ps, twice the arithmetic rate of float32 FMAs, summed in float32;
- "widen" elsewhere (or with NORIA_CPU_BF16_WIDEN=1): W widened to float32 in registers,
  each output the float32 GEMM's in-order sum over the bf16-rounded weight, bit for bit;
- "amx" where the CPU has AMX-BF16 and Linux grants the tiles (worker/gemm_amx_kernels.py;
  NORIA_CPU_NO_AMX=1 keeps "dot" there):
  the dot layout's panels multiplied on 16 x 16 tiles, the MoE experts' one-call path too
  (moe_f32.c calls panel ranges: gemm_amx_panels).

A float16 W takes the "f16" layout: widened to float32 by vcvtph2ps (F16C), each output again
the float32 GEMM's sum over the f16-rounded weight, bit for bit.

Built like worker/gemm_kernels.py (same flags, same switch: worker/cpu_ops.py's gemm family),
called through ctypes; `load()` returns None where no compiler works or the gemm family is on
torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.protocol import switches
from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "gemm_bf16.c"
# No -ffast-math: every output is one in-order sum over K (see the C file).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64, _INT = ctypes.c_int64, ctypes.c_int
_F32P, _U16P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16)


@cache
def load() -> ctypes.CDLL | None:
    if disabled("gemm"):
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    dll.gemm_bf16_nr.argtypes, dll.gemm_bf16_nr.restype = [], _I64
    dll.gemm_bf16_dot_built.argtypes, dll.gemm_bf16_dot_built.restype = [], _INT
    for fn in (dll.gemm_bf16, dll.gemm_bf16_dot, dll.gemm_f16):
        fn.argtypes, fn.restype = [_F32P, _I64, _U16P, _F32P, _F32P, _I64, _I64, _I64, _I64, _INT], None
    for fn in (dll.gemm_bf16_panels, dll.gemm_bf16_dot_panels, dll.gemm_f16_panels):
        fn.argtypes, fn.restype = [_F32P, _I64, _U16P, _F32P, _F32P, _I64, _I64, _I64, _I64, _I64, _I64], None
    for fn in (dll.pack_bf16, dll.pack_bf16_dot, dll.pack_f16):
        fn.argtypes, fn.restype = [_U16P, _I64, _I64, _I64, _U16P, _INT], None
    return dll


# The layouts, by the weight dtype they keep.
LAYOUT_DTYPES = {"dot": torch.bfloat16, "widen": torch.bfloat16, "amx": torch.bfloat16, "f16": torch.float16}
PAIRED = ("dot", "amx")  # the layouts whose panels hold k in pairs


def layout(dtype: torch.dtype = torch.bfloat16) -> str:
    """The layout for weights kept in `dtype`: float16's "f16"; for bfloat16 "amx" where the AMX
    tiles are usable (unless switched to "dot"), else "dot" (vdpbf16ps on bf16-rounded activations)
    where the kernel is built for it, else (or switched off) "widen" (float32 arithmetic on widened
    weights)."""
    if dtype == torch.float16:
        return "f16"
    assert dtype == torch.bfloat16, dtype
    if switches.cpu_bf16_widen() or not _dll().gemm_bf16_dot_built():
        return "widen"
    from noria.worker import gemm_amx_kernels

    return "amx" if not switches.cpu_no_amx() and gemm_amx_kernels.ready() else "dot"


def entry(kind: str) -> ctypes._CFuncPtr:
    """The C function that multiplies by panels of layout `kind`."""
    if kind == "amx":
        from noria.worker import gemm_amx_kernels

        return gemm_amx_kernels.entry()
    return {"dot": _dll().gemm_bf16_dot, "f16": _dll().gemm_f16}.get(kind, _dll().gemm_bf16)


def panels_entry(kind: str) -> ctypes._CFuncPtr:
    """Its panels [p0, p1) on the calling thread alone (gemm_f32_panels' arguments)."""
    if kind == "amx":
        from noria.worker import gemm_amx_kernels

        return gemm_amx_kernels.panels_entry()
    return {"dot": _dll().gemm_bf16_dot_panels, "f16": _dll().gemm_f16_panels}.get(kind, _dll().gemm_bf16_panels)


def _dll() -> ctypes.CDLL:
    dll = load()
    assert dll is not None, "the native bf16 GEMM is not built (see usable())"
    return dll


class PackedHalfWeight:
    """A [N, K] weight, rounded to bf16 or f16 (nearest even) and packed into the panels of
    `kind` (default `layout()`): [ceil(N/NR), K, NR] 16-bit values for all three, k-rows of
    two interleaved vectors for widen, of k pairs for dot (K rounded up to even), of the
    features in order for f16."""

    def __init__(self, weight: torch.Tensor, kind: str | None = None) -> None:
        dll = _dll()
        assert weight.dim() == 2 and weight.is_floating_point(), weight.dtype
        self.kind = kind or layout()
        assert self.kind in LAYOUT_DTYPES and (self.kind not in PAIRED or dll.gemm_bf16_dot_built()), self.kind
        self.dtype = LAYOUT_DTYPES[self.kind]
        nr = int(dll.gemm_bf16_nr())
        self.n, self.k = weight.shape
        self.out_features, self.in_features = self.n, self.k  # PackedWeight's names
        bits = weight.detach().to("cpu", self.dtype).contiguous().view(torch.int16)
        rows = self.k + self.k % 2 if self.kind in PAIRED else self.k
        self.data = torch.empty(-(-self.n // nr), rows, nr, dtype=torch.int16)
        pack = {"dot": dll.pack_bf16_dot, "amx": dll.pack_bf16_dot, "f16": dll.pack_f16}.get(self.kind, dll.pack_bf16)
        if self.data.numel():
            pack(_u16(bits), self.k, self.n, self.k, _u16(self.data), torch.get_num_threads())
        self.ptr = _u16(self.data)  # the data never moves: cast once, not per call
        self._gemm = entry(self.kind)

    def unpack(self) -> torch.Tensor:
        """The [N, K] 16-bit weight back from the panels (the model keeps no other copy)."""
        p, rows, nr = self.data.shape
        if self.kind in PAIRED:  # [p, K / 2, NR, 2]: feature j's k pair is lane j of a pair-row
            w = self.data.view(p, rows // 2, nr, 2).permute(0, 2, 1, 3)
        elif self.kind == "f16":  # [p, K, NR]
            w = self.data.permute(0, 2, 1)
        else:  # [p, K, VL, 2]: 16-bit slot 2i is feature i, slot 2i + 1 feature VL + i
            w = self.data.view(p, rows, nr // 2, 2).permute(0, 3, 2, 1)
        return w.reshape(p * nr, rows)[: self.n, : self.k].view(self.dtype)


def _u16(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _U16P)


def _f32(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _F32P)


def gemm_bf16(x: torch.Tensor, w: PackedHalfWeight, bias: torch.Tensor | None,
              kernel: ctypes._CFuncPtr | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias): [M, N] float32. x float32 on the CPU, any row stride. `kernel`:
    another C function of gemm_f32's arguments over w's panels (default: its layout's)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.dtype, x.shape, w.k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        b = None if bias is None else bias.to(torch.float32).contiguous()  # held: the C reads it
        (kernel or w._gemm)(_f32(x), x.stride(0), w.ptr, None if b is None else _f32(b), _f32(y), w.n, m, w.n,
                            w.k, torch.get_num_threads())
    return y


def usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.dim() == 2 and load() is not None)
