"""A mixture-of-experts block's routed experts in one native call (worker/csrc/moe_f32.c).

The C file gathers each expert's rows, runs the packed GEMMs (gemm_f32.c's, or gemm_bf16.c's
where the experts are kept in bf16) and fused_f32.c's SiLU-and-mul on them and adds the weighted rows back per token in expert order: the
arithmetic of SparseMoeBlock.experts' Python path, bit for bit, in one parallel region
instead of ~5 calls (and as many thread fork/joins) per active expert. It belongs to the
gemm family (worker/cpu_ops.py): `load()` returns None where the GEMM or the fused kernels
are not native, and the block then runs its Python loop.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from pathlib import Path

import torch

from noria.worker import fused_kernels, gemm_bf16_kernels, gemm_kernels
from noria.worker.gemm_bf16_kernels import PackedHalfWeight
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "moe_f32.c"
# -ffp-contract=off: the weighted sum rounds each product before adding it, as torch does.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
MAX_TOP_K = 64  # the C file orders each token's choices in a fixed array of this size


@cache
def load() -> tuple[ctypes.CDLL, int, int, int] | None:
    """(library, float32 GEMM panel function, SiLU-and-mul function, its panel width), or None."""
    gemm, fused = gemm_kernels.load(), fused_kernels.load()
    if gemm is None or fused is None:
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    dll.moe_experts.argtypes = [_P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P,
                                ctypes.c_int]
    dll.moe_experts.restype = ctypes.c_int
    return dll, _addr(gemm.gemm_f32_panels), _addr(fused.silu_mul), int(gemm.gemm_nr())


def _addr(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, _P).value or 0


class PackedExperts:
    """Every expert's packed gate/up and down weights as the arrays of pointers the C call reads,
    and the panel function and width of their kind (all of one kind: float32 or one bf16 layout)."""

    def __init__(self, gate_up: list[PackedWeight] | list[PackedHalfWeight],
                 down: list[PackedWeight] | list[PackedHalfWeight]) -> None:
        lib = load()
        assert lib is not None
        kinds = {w.kind if isinstance(w, PackedHalfWeight) else "float32" for w in [*gate_up, *down]}
        assert len(kinds) == 1, kinds
        kind = kinds.pop()
        if kind == "float32":
            self.panels, self.nr = lib[1], lib[3]
        else:
            self.panels = _addr(gemm_bf16_kernels.panels_entry(kind))
            self.nr = int(gemm_bf16_kernels._dll().gemm_bf16_nr())
        self.num_experts = len(gate_up)
        self.hidden, self.inter = down[0].out_features, down[0].in_features
        self._keep = (gate_up, down)  # the pointers below are into these
        self.gate_up = (_P * self.num_experts)(*(w.data.data_ptr() for w in gate_up))
        self.down = (_P * self.num_experts)(*(w.data.data_ptr() for w in down))


class _Scratch(threading.local):
    """The call's working rows, kept across calls and layers (grown, never shrunk): a fresh
    allocation the size of a prefill chunk's is a fresh mapping, whose page faults cost ~10 %
    of the call. One per thread, as calls on two threads would share nothing else."""

    buffer = torch.empty(0, dtype=torch.float32)

    def get(self, n: int) -> torch.Tensor:
        if self.buffer.numel() < n:
            self.buffer = torch.empty(n, dtype=torch.float32)
        return self.buffer


_scratch = _Scratch()


def usable(x: torch.Tensor, ids: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and ids.shape[1] <= MAX_TOP_K
            and load() is not None)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packed: PackedExperts) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(x): [T, hidden] float32.

    x [T, hidden] float32, weights [T, k] (rounded to float32, as the Python path's product
    is), ids [T, k] in [0, num_experts)."""
    lib = load()
    assert lib is not None
    dll, _, silu, _ = lib
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    t, k = ids.shape
    out = torch.empty(t, packed.hidden, dtype=torch.float32)
    scratch = _scratch.get(t * k * (packed.hidden + 3 * packed.inter))
    rc = dll.moe_experts(packed.panels, silu, packed.nr, x.data_ptr(), t, packed.hidden, packed.inter, packed.num_experts, k,
                         ids.data_ptr(), weights.data_ptr(), packed.gate_up, packed.down, out.data_ptr(),
                         scratch.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError(f"no memory for the scratch of {t} tokens' experts")
    if rc != 0:
        raise ValueError(f"expert ids outside 0..{packed.num_experts - 1} or top-k {k} outside 1..{MAX_TOP_K}")
    return out
