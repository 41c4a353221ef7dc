"""The native float32 GEMM for the CPU linear layers (worker/csrc/gemm_f32.c).

Built by worker/native_build.py with -march=native (so AVX2 or AVX-512, whatever
the host has), called through ctypes on tensors' data pointers. `load()` returns None where no
compiler works or worker/cpu_ops.py puts the gemm family on torch; the layers then
run F.linear.

It keeps no state per row count, so any batch size is served by the same packed
weight at no memory cost.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "gemm_f32.c"
# No -ffast-math: every output is one in-order sum over K (see the C file).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)


@cache
def load() -> ctypes.CDLL | None:
    if disabled("gemm"):
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    dll.gemm_nr.argtypes, dll.gemm_nr.restype = [], _I64
    dll.gemm_f32.argtypes = [_F32P, _I64, _F32P, _F32P, _F32P, _I64, _I64, _I64, _I64, ctypes.c_int]
    dll.gemm_f32.restype = None
    return dll


class PackedWeight:
    """A [N, K] float32 weight in the kernel's panel layout ([ceil(N/NR), K, NR])."""

    def __init__(self, weight: torch.Tensor) -> None:
        dll = load()
        assert dll is not None
        nr = int(dll.gemm_nr())
        n, k = weight.shape
        panels = -(-n // nr)
        padded = torch.zeros(panels * nr, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        self.data = padded.view(panels, nr, k).transpose(1, 2).contiguous()
        self.out_features, self.in_features = n, k
        self.ptr = _ptr(self.data)  # the data never moves: cast once, not per call

    def unpack(self) -> torch.Tensor:
        """The [N, K] weight back from the panels (the model keeps no other copy)."""
        return self.data.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


def _ptr(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _F32P)


def gemm(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias): [M, N]. x float32 on the CPU with unit column stride."""
    dll = load()
    assert dll is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    if m:
        # Held in a local: a temporary's storage would be freed before the C code reads it.
        b = None if bias is None else bias.contiguous()
        dll.gemm_f32(_ptr(x), x.stride(0), w.ptr, None if b is None else _ptr(b),
                     _ptr(y), w.out_features, m, w.out_features, w.in_features, torch.get_num_threads())
    return y


def usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and load() is not None
