"""The native GEMM over bfloat16 weights for the CPU linear layers (worker/csrc/gemm_bf16.c).

x and y stay float32; W is kept in bf16 panels (half the bytes a decode step reads) and
widened to float32 in registers, so each output is the float32 GEMM's in-order sum over the
bf16-rounded weight, bit for bit. Built like worker/gemm_kernels.py (same flags, same
switch: worker/cpu_ops.py's gemm family), called through ctypes; `load()` returns None where
no compiler works or the gemm family is on torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

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
    dll.gemm_bf16.argtypes = [_F32P, _I64, _U16P, _F32P, _F32P, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_bf16.restype = None
    dll.pack_bf16.argtypes = [_U16P, _I64, _I64, _I64, _U16P, _INT]
    dll.pack_bf16.restype = None
    return dll


def _dll() -> ctypes.CDLL:
    dll = load()
    assert dll is not None, "the native bf16 GEMM is not built (see usable())"
    return dll


class PackedBF16Weight:
    """A [N, K] float32 or bfloat16 weight, rounded to bf16 (nearest even) and packed into the
    kernel's panels ([ceil(N/NR), K, NR] bf16 bits, each k-row's two vectors interleaved)."""

    def __init__(self, weight: torch.Tensor) -> None:
        dll = _dll()
        assert weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16), weight.dtype
        nr = int(dll.gemm_bf16_nr())
        self.n, self.k = weight.shape
        bits = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
        self.data = torch.empty(-(-self.n // nr), self.k, nr, dtype=torch.int16)
        if self.data.numel():
            dll.pack_bf16(_u16(bits), self.k, self.n, self.k, _u16(self.data), torch.get_num_threads())
        self.ptr = _u16(self.data)  # the data never moves: cast once, not per call


def _u16(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _U16P)


def _f32(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _F32P)


def gemm_bf16(x: torch.Tensor, w: PackedBF16Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias): [M, N] float32. x float32 on the CPU, any row stride."""
    dll = _dll()
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.dtype, x.shape, w.k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        b = None if bias is None else bias.to(torch.float32).contiguous()  # held: the C reads it
        dll.gemm_bf16(_f32(x), x.stride(0), w.ptr, None if b is None else _f32(b), _f32(y), w.n, m, w.n, w.k,
                      torch.get_num_threads())
    return y


def usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2 and load() is not None)
