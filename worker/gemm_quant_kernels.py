"""The native GEMMs over quantized weights for the CPU linear layers (worker/csrc/gemm_quant.c).

x and y are float32; the weights stay quantized in panels packed once at load:

- W8A8 (`PackedInt8Weight`, `gemm_w8a8`): int8 weights with a float32 scale per output row; the
  activations quantized per row inside the call exactly as `quantize_rows` does, the products summed
  exactly in int32 (vpdpbusd where the build has AVX512_VNNI or AVX_VNNI, vpmaddubsw on AVX2, C
  elsewhere: `isa()`; from a few rows AMX-INT8 tiles where the CPU has them:
  worker/gemm_quant_tiles.py, the same sums), then y = float(sum) * sx * sw + bias.
- weight-only W4A16 / W8A16 (`PackedGroupWeight`, `gemm_wq`): 4- or 8-bit integers with a float32
  scale and an optional zero point per group of input features, q - zero decoded in registers (or
  once per panel into scratch when many row tiles meet it); per group a float32 in-order sum of
  x * (q - zero), times the group's scale, summed over the groups in order (C file for details).
- W4A8 (`PackedInt4Weight`, `gemm_w4a8`, in worker/gemm_quant_groups.py): 4-bit weights with group scales and optional zero points (or
  float group minimums, GGUF Q4_K's w = q * scale - minimum), activations quantized to int8 with one
  scale per row and group of the weight's (`quantize_groups`: W8A8's rule over each group alone, as
  llama.cpp's Q8_0 / Q8_K blocks, so that an outlier feature ~60x the others coarsens only its own
  group, not the whole row: checkpoints not calibrated for int8 activations stay usable); per group an
  exact int32 sum of qx * (q - zero) (vpdpbusd with the nibbles as the unsigned operand), then in
  float32 tot = fma(float(sum) * sx_g, scale_g, tot) over the groups in order, y = tot + bias.
  The per-group activation scale costs one float multiply per output and group over a per-row one (the
  C file has the measured cost).
- W8A8g (`PackedInt8GroupWeight`, `gemm_w8a8g`, worker/gemm_quant_groups.py too): 8-bit weights (-128..127: GGUF Q8_0, Q6_K and the merged
  Q4_K / Q6_K layers, compressed-tensors W8A16) with a float32 scale per group (optional zero points or
  float minimums), on W4A8's activations and with W4A8's sums and order: the int8 dot products' rate for
  the 8-bit weight-only schemes, which on float32 activations run at the float32 GEMM's speed at best.

The native decoder driver calls one GEMM per linear layer with the decoder's signature (decoder_f32.c's
`gemm_fn`: x, ldx, packed, bias, y, ldy, M, N, K, threads); for these kinds `packed` is the address of a
descriptor (`GemmQuantDesc`, held by the packed weight: `desc_ptr`) and the function `entry(kind)`.
FP8 weights (worker/gemm_fp8_kernels.py, a library of its own) have descriptors too: `fp8_desc`, which
carries the address of the fp8 build's kernel for the dispatcher to call (gemm_quant.c says why).

Built like worker/gemm_kernels.py (same flags, same switch: worker/cpu_ops.py's gemm family, and
NORIA_CPU_MARCH), called through ctypes; `load()` returns None where no compiler works or the gemm
family is on torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "gemm_quant.c"
# No -ffast-math: the sums are the ones the C file documents.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64, _INT, _VP = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ISAS = {3: "avx512_vnni", 2: "avx_vnni", 1: "avx2", 0: "portable"}
# The int32 sums are exact while 127 * 128 * K < 2^31.
MAX_W8A8_K = (2**31 - 1) // (127 * 128)


@cache
def load() -> ctypes.CDLL | None:
    if disabled("gemm"):
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    for name in ("gemm_quant_isa", "gemm_quant_i8_shift"):
        getattr(dll, name).argtypes, getattr(dll, name).restype = [], _INT
    for name in ("gemm_quant_i8_nr", "gemm_quant_wq_nr"):
        getattr(dll, name).argtypes, getattr(dll, name).restype = [], _I64
    dll.quant_rows_i8.argtypes, dll.quant_rows_i8.restype = [_VP, _I64, _I64, _I64, _VP, _I64, _VP], None
    dll.quant_groups_i8.argtypes = [_VP, _I64, _I64, _I64, _I64, _VP, _I64, _VP]
    dll.quant_groups_i8.restype = None
    dll.gemm_w8a8.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_w8a8.restype = None
    dll.gemm_wq.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT, _INT]
    dll.gemm_wq.restype = None
    dll.gemm_w4a8.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _INT, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_w4a8.restype = None
    dll.gemm_w8a8g.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT]
    dll.gemm_w8a8g.restype = None
    dll.gemm_quant_layout.argtypes, dll.gemm_quant_layout.restype = [], ctypes.c_int32
    for name in ("gemm_quant_i8_lanes", "gemm_quant_desc_size"):
        getattr(dll, name).argtypes, getattr(dll, name).restype = [], _I64
    for name in _ENTRIES.values():
        getattr(dll, name).argtypes = [_VP, _I64, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _INT]
        getattr(dll, name).restype = None
    if dll.gemm_quant_desc_size() != ctypes.sizeof(GemmQuantDesc):
        raise RuntimeError("gemm_quant.c's GemmQuantDesc and its ctypes mirror differ")
    for name in ("gemm_quant_set_w8a8_tiles", "gemm_quant_set_w4a8_tiles"):
        getattr(dll, name).argtypes, getattr(dll, name).restype = [_VP, _I64], _INT
    from noria.worker import gemm_quant_tiles

    gemm_quant_tiles.choose_w8a8(dll)
    return dll


def _pack_int8(q: torch.Tensor, nr: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 panels [ceil(N / nr), ceil(K / 4), nr, 4] of q int8 [N, K] (zero padded), and each padded
    feature's 128 * sum of its weights where the build shifts x to unsigned (`shift`), else zeros."""
    n, k = q.shape
    p, k4 = _panels(n, nr), -(-k // 4)
    padded = torch.zeros(p * nr, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = q.cpu()
    data = padded.view(p, nr, k4, 4).transpose(1, 2).contiguous()
    return data, (padded.sum(dim=1, dtype=torch.int32) * 128 * shift).to(torch.int32)


def usable() -> bool:
    return load() is not None


def isa() -> str:
    """The int8 path the build took: "avx512_vnni", "avx_vnni", "avx2" or "portable"."""
    return _ISAS[int(_dll().gemm_quant_isa())]


def _dll() -> ctypes.CDLL:
    dll = load()
    assert dll is not None, "the native quantized GEMMs are not built (see usable())"
    return dll


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _panels(n: int, nr: int) -> int:
    return -(-n // nr)


# "any": the entry that dispatches on the descriptor's own kind (a model of mixed kinds, one entry).
_ENTRIES = {"w8a8": "gemm_w8a8_desc", "wq": "gemm_wq_desc", "w4a8": "gemm_w4a8_desc", "w8a8g": "gemm_w8a8g_desc",
            "fp8": "gemm_fp8_desc", "any": "gemm_quant_desc"}
_KINDS = {"w8a8": 1, "wq": 2, "w4a8": 3, "w8a8g": 4, "fp8": 5}
_MAGIC = 0x31445147  # "GQD1"


class GemmQuantDesc(ctypes.Structure):
    """gemm_quant.c's descriptor of a packed weight (what the decoder driver passes as `packed`)."""

    _fields_ = [("magic", ctypes.c_uint32), ("kind", ctypes.c_int32), ("layout", ctypes.c_int32),
                ("bits", ctypes.c_int32), ("n", _I64), ("k", _I64), ("group", _I64), ("data", _VP), ("scale", _VP),
                ("zero", _VP), ("corr", _VP), ("minimum", _VP), ("offset", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("fp8", _VP)]


def _desc(dll: ctypes.CDLL, kind: str, bits: int, n: int, k: int, group: int, data: torch.Tensor,
          scale: torch.Tensor, zero: torch.Tensor | None = None, corr: torch.Tensor | None = None,
          minimum: torch.Tensor | None = None, offset: int = 0) -> GemmQuantDesc:
    """A descriptor pointing into the tensors (the caller keeps them alive, and them unchanged)."""
    return GemmQuantDesc(_MAGIC, _KINDS[kind], int(dll.gemm_quant_layout()), bits, n, k, group, _p(data),
                         _p(scale), _p(zero), _p(corr), _p(minimum), offset, 0)


def fp8_desc(n: int, k: int, group: int, data: torch.Tensor, scale: torch.Tensor, kernel: int,
             layout: int) -> GemmQuantDesc | None:
    """An fp8 weight's descriptor: its panels and scales as worker/gemm_fp8_kernels.py packs them, and
    `kernel`, the address of gemm_fp8 in the build that packed them (`layout`: that build's
    gemm_fp8_layout()). None where this library is not built (the weight then runs only layer by layer)."""
    if load() is None:
        return None
    return GemmQuantDesc(_MAGIC, _KINDS["fp8"], layout, 8, n, k, group, _p(data), _p(scale), None, None, None, 0,
                         0, kernel)


def entry(kind: str) -> int:
    """The address of the C function with the decoder driver's GEMM signature (decoder_f32.c's gemm_fn)
    for packed weights of `kind` ("w8a8", "wq", "w4a8", "w8a8g", "fp8", or "any": whichever the descriptor says), its
    `packed` argument a weight's `desc_ptr`.
    The weight must come from this build (the entry aborts on a descriptor of another layout)."""
    if kind not in _ENTRIES:
        raise ValueError(f"no quantized GEMM entry for {kind!r}: one of {', '.join(_ENTRIES)}")
    return ctypes.cast(getattr(_dll(), _ENTRIES[kind]), _VP).value or 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8 (vLLM's rule): s = max|x_row| / 127, q = x / s rounded half to
    even, clamped to [-127, 127]. A row whose s is 0 (all zeros, or max / 127 underflows) gets s = 1
    (so q = round(x) = 0); a row holding a NaN or an infinity gets s = NaN and q = 0. Returns (q int8
    [M, K], s float32 [M]); the C kernel quantizes bit for bit like this."""
    x = x.to(torch.float32)
    m, k = x.shape
    if k == 0:
        return torch.zeros(m, 0, dtype=torch.int8), torch.ones(m)
    amax = x.abs().amax(dim=1)
    s = amax / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    finite = torch.isfinite(amax)
    q = torch.where(finite[:, None], torch.round(x / s[:, None]).clamp(-127, 127), 0).to(torch.int8)
    return q, torch.where(finite, s, torch.full_like(s, float("nan")))


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's activations: `quantize_rows`'s rule over each group of `group` consecutive features of a row
    alone: s[m, g] = max|x| over the group / 127 (1 where that is 0; NaN, with the group's q all 0, where
    the group holds a NaN or an infinity), q = x / s rounded half to even, clamped to [-127, 127].
    group must divide K. Returns (q int8 [M, K], s float32 [M, K // group]); the C kernel quantizes
    bit for bit like this."""
    x = x.to(torch.float32)
    m, k = x.shape
    if group <= 0 or k % group:
        raise ValueError(f"the group size {group} must divide K = {k}")
    q, s = quantize_rows(x.reshape(m * (k // group), group))
    return q.reshape(m, k), s.reshape(m, k // group)


def _quantize_groups_native(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups by the C kernel's own code (for the tests). x float32 with unit column stride."""
    assert x.dtype == torch.float32 and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)
    m, k = x.shape
    assert group > 0 and k % group == 0
    q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // group, dtype=torch.float32)
    if m and k:
        _dll().quant_groups_i8(x.data_ptr(), x.stride(0), m, k, group, q.data_ptr(), k, s.data_ptr())
    return q, s


def _quantize_rows_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows by the C kernel's own code (for the tests). x float32 with unit column stride."""
    assert x.dtype == torch.float32 and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)
    m, k = x.shape
    q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
    if m and k:
        _dll().quant_rows_i8(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), k, s.data_ptr())
    elif m:
        s.fill_(1)
    return q, s


class PackedInt8Weight:
    """W8A8: int8 weights with one float32 scale per output row (symmetric), in the int8 kernel's
    panels: [ceil(N / NR), ceil(K / 4), NR, 4] int8 (k in groups of 4 per feature, zero padded)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self._dll = dll = _dll()  # the build that packed it computes with it (NR and corr are the build's)
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"W8A8 weights must be int8 [N, K], not {q.dtype} {tuple(q.shape)}")
        self.n, self.k = q.shape
        if scale.shape != (self.n,) or not scale.is_floating_point():
            raise ValueError(f"W8A8 weight scales must be float [{self.n}], not {scale.dtype} {tuple(scale.shape)}")
        if self.k > MAX_W8A8_K:
            raise ValueError(f"W8A8 needs K <= {MAX_W8A8_K} (exact int32 sums), not {self.k}")
        self.out_features, self.in_features = self.n, self.k
        nr = int(dll.gemm_quant_i8_nr())
        # corr, 128 * sum_k w: what the unsigned shift of x adds to each sum where the build uses vpdpbusd.
        self.data, self.corr = _pack_int8(q, nr, int(dll.gemm_quant_i8_shift()))
        self.scale = torch.zeros(self.data.shape[0] * nr, dtype=torch.float32)
        self.scale[: self.n] = scale.detach().cpu().to(torch.float32)
        self.nbytes = self.data.numel() + 4 * self.scale.numel() + 4 * self.corr.numel()
        self.desc = _desc(dll, "w8a8", 8, self.n, self.k, 0, self.data, self.scale, corr=self.corr)
        self.desc_ptr: int = ctypes.addressof(self.desc)
        self.entry_kind = "w8a8"

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale float32 [N]) back from the panels."""
        p, k4, nr, _ = self.data.shape
        q = self.data.transpose(1, 2).reshape(p * nr, k4 * 4)[: self.n, : self.k]
        return q.contiguous(), self.scale[: self.n].clone()


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [M, {k}] on the CPU, not {x.dtype} {tuple(x.shape)} on {x.device}")
    return x if x.stride(1) == 1 or k <= 1 else x.contiguous()


def _bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], not {tuple(bias.shape)}")
    return bias.detach().to(torch.float32).contiguous()


def gemm_w8a8(x: torch.Tensor, w: PackedInt8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (any row stride) -> float32 [M, N]:
    y[m, n] = float(sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n] + bias[n], (qx, sx) = quantize_rows(x)."""
    x = _check_x(x, w.k)
    b = _bias(bias, w.n)  # held: the C reads it
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        if w.k == 0:
            y.zero_()
            return y if b is None else y + b
        w._dll.gemm_w8a8(x.data_ptr(), x.stride(0), w.data.data_ptr(), w.corr.data_ptr(), w.scale.data_ptr(),
                         _p(b), y.data_ptr(), w.n, m, w.n, w.k, torch.get_num_threads())
    return y


class PackedGroupWeight:
    """Weight-only W4A16 / W8A16: integer values with a float32 scale (and optionally an integer zero
    point) per group of `group` input features, in the kernel's panels of NR features: at 4 bits
    [P, K, NR / 2] bytes, two values per byte (byte j holds feature j's value + 8 in the low nibble
    and feature NR / 2 + j's in the high one), at 8 bits [P, K, NR] bytes (value + 128); scales
    [P, K / group, NR] float32; zero points [P, K / group, NR] bytes (zero + 8 or + 128) or None."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                 bits: int) -> None:
        self._dll = dll = _dll()
        if bits not in (4, 8):
            raise ValueError(f"weight-only quantization takes bits 4 or 8, not {bits}")
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"quantized weights must be int8 [N, K], not {q.dtype} {tuple(q.shape)}")
        self.n, self.k = q.shape
        if group <= 0 or self.k % group:
            raise ValueError(f"the group size {group} must divide K = {self.k}")
        lo, hi = (-8, 7) if bits == 4 else (-128, 127)
        groups = self.k // group
        for name, t in (("weights", q), ("zero points", zero)):
            if t is not None and t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
                raise ValueError(f"{bits}-bit {name} must lie in [{lo}, {hi}]")
        if scale.shape != (self.n, groups) or not scale.is_floating_point():
            raise ValueError(f"scales must be float [{self.n}, {groups}], not {scale.dtype} {tuple(scale.shape)}")
        if zero is not None and (zero.shape != (self.n, groups) or zero.dtype != torch.int8):
            raise ValueError(f"zero points must be int8 [{self.n}, {groups}], not {zero.dtype} {tuple(zero.shape)}")
        self.bits, self.group = bits, group
        self.out_features, self.in_features = self.n, self.k
        nr = int(dll.gemm_quant_wq_nr())
        p, off = _panels(self.n, nr), 8 if bits == 4 else 128

        def features_last(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            """[N, C] -> [P, C, NR] (features padded to P * NR with zeros)."""
            padded = torch.zeros(p * nr, t.shape[1], dtype=dtype)
            padded[: self.n] = t
            return padded.view(p, nr, -1).transpose(1, 2).contiguous()

        u = features_last(q.cpu().to(torch.int16) + off, torch.int16).to(torch.uint8)  # [P, K, NR]
        self.data = u if bits == 8 else u[:, :, : nr // 2] | (u[:, :, nr // 2 :] << 4)
        self.scale = features_last(scale.detach().cpu().to(torch.float32), torch.float32)
        self.zero = None if zero is None else features_last(zero.cpu().to(torch.int16) + off,
                                                            torch.int16).to(torch.uint8)
        self.nbytes = self.data.numel() + 4 * self.scale.numel() + (0 if self.zero is None else self.zero.numel())
        self.desc = _desc(dll, "wq", bits, self.n, self.k, group, self.data, self.scale, zero=self.zero)
        self.desc_ptr: int = ctypes.addressof(self.desc)
        self.entry_kind = "wq"

    def _features_first(self, t: torch.Tensor) -> torch.Tensor:
        """[P, C, NR] -> [N, C]."""
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: self.n]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q int8 [N, K], scale float32 [N, K / group], zero int8 [N, K / group] or None) back."""
        off = 8 if self.bits == 4 else 128
        u = self.data if self.bits == 8 else torch.cat([self.data & 15, self.data >> 4], dim=2)
        q = (self._features_first(u).to(torch.int16) - off).to(torch.int8)
        zero = None if self.zero is None else (self._features_first(self.zero).to(torch.int16) - off).to(torch.int8)
        return q, self._features_first(self.scale).contiguous(), zero

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: (q - zero) * scale, rounded once (what a float GEMM would multiply by)."""
        q, scale, zero = self.unpack()
        diff = q.float() if zero is None else q.float() - zero.float().repeat_interleave(self.group, dim=1)
        return diff * scale.repeat_interleave(self.group, dim=1)


def gemm_wq(x: torch.Tensor, w: PackedGroupWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (any row stride) -> float32 [M, N]: y = x @ ((q - zero) * scale).T + bias in float32:
    per group g, part = sum over its k in order of x * (q - zero) (fused multiply-adds), then
    total = part * scale_g + total over the groups in order, then + bias. The same bits whatever the
    thread count and the other rows of the batch."""
    x = _check_x(x, w.k)
    b = _bias(bias, w.n)
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        if w.k == 0:
            y.zero_()
            return y if b is None else y + b
        w._dll.gemm_wq(x.data_ptr(), x.stride(0), w.data.data_ptr(), _p(w.zero), w.scale.data_ptr(), _p(b),
                       y.data_ptr(), w.n, m, w.n, w.k, w.group, w.bits, torch.get_num_threads())
    return y
