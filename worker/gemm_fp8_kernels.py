"""The native GEMM over FP8 (e4m3fn) weights for the CPU linear layers (worker/csrc/gemm_fp8.c).

x and y are float32; the weights stay one byte each, in panels packed once at load, with a float32
scale per output row and group of input features (one group: per-channel or per-tensor scales; a
block-scaled checkpoint's 128 x 128 blocks as groups of 128 with each block's scale on its rows).
Each byte is widened exactly in registers (the C file says how), in one of two layouts, `layout()`:

- "dot" where the build has AVX512_BF16 and AVX512_VBMI: the bytes widened to bf16, x rounded to
  bf16 (nearest even) once per call, vdpbf16ps multiplying pairs of k at twice the float32 FMA's
  rate, float32 sums: per group g, part = sum over its (k, k + 1) pairs in order of the pair's
  two products;
- "widen" elsewhere: the bytes widened to float32, x float32: per group g, part = sum over its k
  in order of x * w (fused multiply-adds), the same bits on every widening build (AVX-512, AVX2,
  portable C);

then on both total = part * scale_g + total over the groups in order (fused), y = total + bias.
No output depends on the thread count or on the batch's other rows.

A checkpoint's activation scheme (dynamic per token, or a static `input_scale`) is what the GPU's
`_scaled_mm` kind computes; here the reference is transformers' dequantized model, which multiplies
float activations by the dequantized weights: "widen" computes that, "dot" that on bf16-rounded
activations (still finer than the e4m3 ones the checkpoint was calibrated for).

Built like worker/gemm_quant_kernels.py (same flags, same switches: worker/cpu_ops.py's gemm family,
NORIA_CPU_MARCH for another host's instruction set), called through ctypes; `load()` returns None
where no compiler works or the gemm family is on torch. A packed weight also has a descriptor
(`desc_ptr`, worker/gemm_quant_kernels.py's GemmQuantDesc of kind fp8, holding this build's
`gemm_fp8`), through which the native decoder stack's one quantized GEMM entry calls this kernel,
the same call on the same arguments as the layer's own.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker import gemm_quant_kernels
from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "gemm_fp8.c"
# No -ffast-math: the sums are the ones the C file documents.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64, _INT, _VP = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ISAS = {2: "avx512", 1: "avx2", 0: "portable"}
# The widened bytes are w * 2^-8 (half precision's exponent bias; the dot layout's tables follow): the
# scales carry the 2^8.
_WIDEN = 256.0
# Where the dot layout's 64-byte pair-row keeps its bytes: byte 16L + 8v + i holds 16-bit element
# 8L + i of vector v (the C's vpunpck{l,h}bw interleave), element e of vector v being (feature
# 16v + e // 2, k parity e % 2), i.e. byte 32v + e of the pair-row in (feature, parity) order.
_PAIR_SRC = torch.tensor([32 * v + 8 * lane + i for lane in range(4) for v in range(2) for i in range(8)])
_PAIR_DST = torch.argsort(_PAIR_SRC)


@cache
def load() -> ctypes.CDLL | None:
    if disabled("gemm"):
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    dll.gemm_fp8_isa.argtypes, dll.gemm_fp8_isa.restype = [], _INT
    dll.gemm_fp8_dot_built.argtypes, dll.gemm_fp8_dot_built.restype = [], _INT
    dll.gemm_fp8_nr.argtypes, dll.gemm_fp8_nr.restype = [], _I64
    dll.gemm_fp8_layout.argtypes, dll.gemm_fp8_layout.restype = [], ctypes.c_int32
    dll.gemm_fp8.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_fp8.restype = None
    return dll


def usable() -> bool:
    return load() is not None


def isa() -> str:
    """The path the build took: "avx512", "avx2" or "portable"."""
    return _ISAS[int(_dll().gemm_fp8_isa())]


def layout() -> str:
    """The build's layout: "dot" (vdpbf16ps on bf16-rounded activations) or "widen" (float32)."""
    return "dot" if _dll().gemm_fp8_dot_built() else "widen"


def _dll() -> ctypes.CDLL:
    dll = load()
    assert dll is not None, "the native fp8 GEMM is not built (see usable())"
    return dll


class PackedFp8Weight:
    """e4m3fn weights [N, K] with float32 scales [N, K / group], in the kernel's panels (features
    padded to P * NR with zeros): bytes [P, K, NR] k-major ("widen"), or [P, K', NR] ("dot"): each
    group padded to even length (K' = K / group * 2 * ceil(group / 2)), each pair of k a 2 * NR-byte
    pair-row in `_PAIR_SRC`'s order; scales [P, K / group, NR] times 256."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group: int) -> None:
        self._dll = dll = _dll()  # the build that packed it computes with it (NR and the layout are the build's)
        if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
            raise ValueError(f"fp8 weights must be float8_e4m3fn [N, K], not {q.dtype} {tuple(q.shape)}")
        self.n, self.k = q.shape
        if group <= 0 or self.k % group:
            raise ValueError(f"the group size {group} must divide K = {self.k}")
        groups = self.k // group
        if scale.shape != (self.n, groups) or not scale.is_floating_point():
            raise ValueError(f"fp8 weight scales must be float [{self.n}, {groups}], not {scale.dtype} "
                             f"{tuple(scale.shape)}")
        raw = q.detach().cpu().contiguous().view(torch.uint8)
        if bool(((raw & 0x7F) == 0x7F).any()):
            raise ValueError("fp8 weights hold NaN (e4m3fn bytes 0x7f / 0xff)")
        s = scale.detach().cpu().to(torch.float32)
        if not bool(torch.isfinite(s * _WIDEN).all()):
            raise ValueError("fp8 weight scales must be finite (and below 2^119)")
        self.group, self.out_features, self.in_features = group, self.n, self.k
        self.kind = "dot" if dll.gemm_fp8_dot_built() else "widen"
        self._nr = nr = int(dll.gemm_fp8_nr())
        self._p = p = -(-self.n // nr)

        def features_last(t: torch.Tensor) -> torch.Tensor:
            """[N, C] -> [P, C, NR] (features padded to P * NR with zeros)."""
            padded = torch.zeros(p * nr, t.shape[1], dtype=t.dtype)
            padded[: self.n] = t
            return padded.view(p, nr, -1).transpose(1, 2).contiguous()

        self.data = self._pairs(raw) if self.kind == "dot" else features_last(raw)
        self.scale = features_last(s * _WIDEN)
        self.nbytes = self.data.numel() + 4 * self.scale.numel()
        kernel = ctypes.cast(dll.gemm_fp8, _VP).value or 0
        # Held here with the tensors it points into (and the library, through self._dll).
        self.desc = gemm_quant_kernels.fp8_desc(self.n, self.k, group, self.data, self.scale, kernel,
                                                int(dll.gemm_fp8_layout()))
        self.desc_ptr: int | None = None if self.desc is None else ctypes.addressof(self.desc)

    def _pairs(self, raw: torch.Tensor) -> torch.Tensor:
        """[N, K] bytes -> the dot layout's [P, K', NR]."""
        p, nr, groups, half = self._p, self._nr, self.k // self.group, -(-self.group // 2)
        padded = torch.zeros(p * nr, groups, 2 * half, dtype=torch.uint8)
        padded[: self.n, :, : self.group] = raw.view(self.n, groups, self.group)
        rows = padded.view(p, nr, groups * half, 2).permute(0, 2, 1, 3).reshape(p, groups * half, 2 * nr)
        return rows[..., _PAIR_SRC].reshape(p, 2 * groups * half, nr).contiguous()

    def _features_first(self, t: torch.Tensor) -> torch.Tensor:
        """[P, C, NR] -> [N, C]."""
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: self.n]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q float8_e4m3fn [N, K], scale float32 [N, K / group]) back from the panels."""
        if self.kind == "dot":
            p, nr, groups = self._p, self._nr, self.k // self.group
            rows = self.data.view(p, -1, 2 * nr)[..., _PAIR_DST]  # pair-rows in (feature, parity) order
            q = rows.view(p, -1, nr, 2).permute(0, 2, 1, 3).reshape(p * nr, groups, -1)
            q = q[: self.n, :, : self.group].reshape(self.n, self.k)
        else:
            q = self._features_first(self.data)
        return q.contiguous().view(torch.float8_e4m3fn), self._features_first(self.scale) / _WIDEN

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: w * scale per group, rounded once."""
        q, scale = self.unpack()
        return q.float() * scale.repeat_interleave(self.group, dim=1)


def gemm_fp8(x: torch.Tensor, w: PackedFp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (any row stride) -> float32 [M, N]: x @ (w * scale).T + bias in the order of
    the module docstring."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [M, {w.k}] on the CPU, not {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1 and w.k > 1:
        x = x.contiguous()
    b = None
    if bias is not None:
        if bias.shape != (w.n,):
            raise ValueError(f"bias must be [{w.n}], not {tuple(bias.shape)}")
        b = bias.detach().to(torch.float32).contiguous()  # held: the C reads it
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        if w.k == 0:
            y.zero_()
            return y if b is None else y + b
        w._dll.gemm_fp8(x.data_ptr(), x.stride(0), w.data.data_ptr(), w.scale.data_ptr(),
                        None if b is None else b.data_ptr(), y.data_ptr(), w.n, m, w.n, w.k, w.group,
                        torch.get_num_threads())
    return y
