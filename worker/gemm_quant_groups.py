"""The quantized GEMMs whose activations are rounded to int8 per row and group of the weight's
group (worker/gemm_quant_kernels.py's `quantize_groups`): W4A8 (`PackedInt4Weight`, `gemm_w4a8`)
and W8A8g (`PackedInt8GroupWeight`, `gemm_w8a8g`), in worker/csrc/gemm_quant.c.

Both keep a float32 scale per group of `group` input features and either an int zero point per
group (w = (q - zero) * scale) or a float32 minimum per group (w = q * scale - minimum: GGUF's
Q4_K, and the merged Q4_K / Q6_K layers) or neither; both sum per group exactly in int32, then in
float32 tot = fma(float32(float(i_g) * sx[m, g]), scale_g, tot) over the groups in order (with
minimums then tot = fma(float32(-float(sum_g qx) * sx[m, g]), minimum_g, tot)), y = tot + bias
(tot without a bias). A row with a NaN or an infinity gives NaNs. The same bits whatever the ISA
build, the thread count and the batch's other rows. They differ in how the values are stored
(`_pack_values` / `_unpack_values`): nibbles for 4 bits, bytes for 8.
"""

from __future__ import annotations

import ctypes

import torch

from noria.worker.gemm_quant_kernels import _bias, _check_x, _desc, _dll, _p, _panels

# The int32 sums of W4A8 are exact while 15 * 127 * group < 2^31; their float32 conversion while < 2^24.
MAX_W4A8_GROUP = (2**31 - 1) // (15 * 127)
# The int32 sums of W8A8g are exact while 255 * 127 * group < 2^31 (|q - zero| <= 255, |qx| <= 127).
MAX_W8A8G_GROUP = (2**31 - 1) // (255 * 127)


class _GroupWeight:
    """What W4A8 and W8A8g weights share: the checks, the per-group scales, zero points (stored +
    `offset`) and minimums in [P, K / group, NR8] panels of the int8 kernel's width, the
    descriptor, unpacking and dequantizing."""

    name, bits, kind, max_group = "", 0, "", 0

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                 minimum: torch.Tensor | None = None) -> None:
        self._dll = dll = _dll()
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"{self.bits}-bit weights must be int8 [N, K], not {q.dtype} {tuple(q.shape)}")
        self.n, self.k = q.shape
        if group <= 0 or group % 4:
            raise ValueError(f"the {self.name} group size must be a positive multiple of 4, not {group}")
        if self.k % group:
            raise ValueError(f"the group size {group} must divide K = {self.k}")
        if group > self.max_group:
            raise ValueError(f"{self.name} needs group <= {self.max_group} (exact int32 sums), not {group}")
        if zero is not None and minimum is not None:
            raise ValueError(f"{self.name} takes zero points or minimums, not both")
        groups = self.k // group
        self._check_values(q, zero, minimum is not None)
        for name, t in (("scales", scale), ("minimums", minimum)):
            if t is not None and (t.shape != (self.n, groups) or not t.is_floating_point()):
                raise ValueError(f"{name} must be float [{self.n}, {groups}], not {t.dtype} {tuple(t.shape)}")
        if zero is not None and (zero.shape != (self.n, groups) or zero.dtype != torch.int8):
            raise ValueError(f"zero points must be int8 [{self.n}, {groups}], not {zero.dtype} {tuple(zero.shape)}")
        self.group = group
        self.offset = self._offset(minimum is not None)
        self.out_features, self.in_features = self.n, self.k
        self._nr = int(dll.gemm_quant_i8_nr())
        self._p = _panels(self.n, self._nr)
        self.data = self._pack_values(q)
        self.scale = self._features_last(scale.detach().cpu().to(torch.float32), torch.float32)
        self.zero = None if zero is None else self._features_last(zero.cpu().to(torch.int16) + self.offset,
                                                                  torch.int16).to(torch.uint8)
        self.minimum = None if minimum is None else self._features_last(minimum.detach().cpu().to(torch.float32),
                                                                        torch.float32)
        self.nbytes = (self.data.numel() + 4 * self.scale.numel() + (0 if self.zero is None else self.zero.numel())
                       + (0 if self.minimum is None else 4 * self.minimum.numel()))
        self.desc = _desc(dll, self.kind, self.bits, self.n, self.k, group, self.data, self.scale, zero=self.zero,
                          minimum=self.minimum, offset=self.offset)
        self.desc_ptr: int = ctypes.addressof(self.desc)
        self.entry_kind = self.kind

    def _check_values(self, q: torch.Tensor, zero: torch.Tensor | None, minimums: bool) -> None:
        pass

    def _offset(self, minimums: bool) -> int:
        raise NotImplementedError

    def _pack_values(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _unpack_values(self) -> torch.Tensor:
        """The stored values u = q + offset back, uint8 [N, K]."""
        raise NotImplementedError

    def _features_last(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, C] -> [P, C, NR8] (features padded with zeros)."""
        padded = torch.zeros(self._p * self._nr, t.shape[1], dtype=dtype)
        padded[: self.n] = t
        return padded.view(self._p, self._nr, -1).transpose(1, 2).contiguous()

    def _features_first(self, t: torch.Tensor) -> torch.Tensor:
        """[P, C, NR8] -> [N, C]."""
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: self.n]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(q int8 [N, K], scale float32 [N, K / group], zero int8 or None, minimum float32 or None) back."""
        q = (self._unpack_values().to(torch.int16) - self.offset).to(torch.int8)
        zero = None if self.zero is None else (self._features_first(self.zero).to(torch.int16)
                                               - self.offset).to(torch.int8)
        minimum = None if self.minimum is None else self._features_first(self.minimum).contiguous()
        return q, self._features_first(self.scale).contiguous(), zero, minimum

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: (q - zero) * scale or q * scale - minimum, each rounded once."""
        q, scale, zero, minimum = self.unpack()
        diff = q.float() if zero is None else q.float() - zero.float().repeat_interleave(self.group, dim=1)
        w = diff * scale.repeat_interleave(self.group, dim=1)
        return w if minimum is None else w - minimum.repeat_interleave(self.group, dim=1)


class PackedInt4Weight(_GroupWeight):
    """W4A8 (`gemm_w4a8`): q and zero in [-8, 7], or q in [0, 15] with minimums. Stored as u = q +
    offset in [0, 15] (offset 8 for signed q, 0 with minimums), in the int8 kernel's panels of NR8 =
    NV vectors of L lanes x 4 k: [P, K / 4, NV / 2, L * 4] bytes, vector j's byte in the low nibble
    and vector j + NV / 2's in the high one (K / 2 bytes per feature); zero points stored + 8.
    group: a multiple of 4 dividing K, at most MAX_W4A8_GROUP."""

    name, bits, kind, max_group = "W4A8", 4, "w4a8", MAX_W4A8_GROUP

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                 minimum: torch.Tensor | None = None) -> None:
        super().__init__(q, scale, zero, group, minimum)
        _choose_w4a8_tiles()  # before any call can reach gemm_w4a8, the native stack's included

    def _check_values(self, q: torch.Tensor, zero: torch.Tensor | None, minimums: bool) -> None:
        lo, hi = (0, 15) if minimums else (-8, 7)
        for name, t in (("weights", q), ("zero points", zero)):
            if t is not None and t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
                raise ValueError(f"4-bit {name} must lie in [{lo}, {hi}]")

    def _offset(self, minimums: bool) -> int:
        return 0 if minimums else 8

    def _lanes(self) -> tuple[int, int]:
        lanes = int(self._dll.gemm_quant_i8_lanes())
        return self._nr // lanes, lanes

    def _pack_values(self, q: torch.Tensor) -> torch.Tensor:
        nv, lanes = self._lanes()
        u = torch.zeros(self._p * self._nr, self.k, dtype=torch.uint8)
        u[: self.n] = (q.cpu().to(torch.int16) + self.offset).to(torch.uint8)
        # [P, NV, L, K4, 4] -> [P, K4, NV, L * 4]: vector v's lane l is feature v * L + l, 4 k to a lane.
        u = u.view(self._p, nv, lanes, self.k // 4, 4).permute(0, 3, 1, 2, 4).reshape(self._p, self.k // 4, nv,
                                                                                       lanes * 4)
        return (u[:, :, : nv // 2] | (u[:, :, nv // 2 :] << 4)).contiguous()

    def _unpack_values(self) -> torch.Tensor:
        nv, lanes = self._lanes()
        p, k4 = self.data.shape[:2]
        u = torch.cat([self.data & 15, self.data >> 4], dim=2)  # [P, K4, NV, L * 4]
        return u.view(p, k4, nv, lanes, 4).permute(0, 2, 3, 1, 4).reshape(p * self._nr, self.k)[: self.n]


class PackedInt8GroupWeight(_GroupWeight):
    """W8A8g (`gemm_w8a8g`): q in [-128, 127] (GGUF Q8_0, Q6_K and the merged Q4_K / Q6_K layers,
    compressed-tensors W8A16), zero points in [-128, 127]. Stored as u = q + 128 in W8A8's panels,
    [P, K / 4, NR8, 4] bytes (4 k of a feature per int32 lane); zero points stored + 128.
    group: a multiple of 4 dividing K, at most MAX_W8A8G_GROUP."""

    name, bits, kind, max_group = "W8A8g", 8, "w8a8g", MAX_W8A8G_GROUP

    def _offset(self, minimums: bool) -> int:
        return 128

    def _pack_values(self, q: torch.Tensor) -> torch.Tensor:
        u = torch.full((self._p * self._nr, self.k), 128, dtype=torch.uint8)  # padding features: q = 0
        u[: self.n] = (q.cpu().to(torch.int16) + 128).to(torch.uint8)
        return u.view(self._p, self._nr, self.k // 4, 4).transpose(1, 2).contiguous()  # [P, K4, NR8, 4]

    def _unpack_values(self) -> torch.Tensor:
        p, k4, nr, _ = self.data.shape
        return self.data.transpose(1, 2).reshape(p * nr, k4 * 4)[: self.n]


def _group_gemm(x: torch.Tensor, w: _GroupWeight, bias: torch.Tensor | None, fn: ctypes._CFuncPtr,
                *middle: int) -> torch.Tensor:
    x = _check_x(x, w.k)
    b = _bias(bias, w.n)
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m and w.n:
        if w.k == 0:
            y.zero_()
            return y if b is None else y + b
        fn(x.data_ptr(), x.stride(0), w.data.data_ptr(), _p(w.zero), w.scale.data_ptr(), _p(w.minimum), *middle,
           _p(b), y.data_ptr(), w.n, m, w.n, w.k, w.group, torch.get_num_threads())
    return y


# From this many rows gemm_w4a8 runs on AMX-INT8 tiles where they are chosen (4-bit weights without
# minimums, groups of a multiple of 64): each call decodes its panels' nibbles into bytes once, which
# a few rows do not pay back.
W4A8_TILE_ROWS = 16
_w4a8_tiles: list[int | None] = []  # [] until chosen (at the first 4-bit weight); then [address or None, rows]


def set_w4a8_tiles(address: int | None, min_rows: int = W4A8_TILE_ROWS) -> bool:
    """Give gemm_w4a8 the tile kernel at `address` (gemm_amx_kernels.w4a8_tiles_address) for calls of
    at least `min_rows` rows, or None: vpdpbusd always. False where this build's panels are not the
    tiles' layout (only the 512-bit VNNI build's are)."""
    if _dll().gemm_quant_set_w4a8_tiles(address, min_rows) != 0:
        return False
    _w4a8_tiles[:] = [address, min_rows]
    return True


def w4a8_tiles() -> tuple[int | None, int]:
    """(the tile kernel's address or None, its minimum rows): what gemm_w4a8 runs on now."""
    _choose_w4a8_tiles()
    return _w4a8_tiles[0], int(_w4a8_tiles[1] or 0)


def _choose_w4a8_tiles() -> None:
    """Once, at the first 4-bit weight packed: AMX-INT8 tiles for W4A8 where they are usable,
    NORIA_CPU_NO_AMX is not set, and on ragged products (rows off the tiles' 16, features off 64,
    two groups of 128, with and without zero points, a bias) they give the vpdpbusd kernel's bits."""
    if _w4a8_tiles:
        return
    _w4a8_tiles[:] = [None, W4A8_TILE_ROWS]  # before the check's own weights come back here
    from noria.protocol import switches
    from noria.worker import gemm_amx_kernels

    address = None if switches.cpu_no_amx() else gemm_amx_kernels.w4a8_tiles_address(emulate=False)
    if address is None or not set_w4a8_tiles(None):
        return
    g = torch.Generator().manual_seed(0)
    n, k, m, group = 100, 256, 37, 128
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for zero in (None, torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8)):
        w = PackedInt4Weight(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8),
                             torch.rand(n, k // group, generator=g) / 8, zero, group)
        want = gemm_w4a8(x, w, bias)
        set_w4a8_tiles(address, 1)
        got = gemm_w4a8(x, w, bias)
        set_w4a8_tiles(None)
        if not torch.equal(got, want):
            return
    set_w4a8_tiles(address, W4A8_TILE_ROWS)


def gemm_w4a8(x: torch.Tensor, w: PackedInt4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (any row stride) -> float32 [M, N], (qx, sx) = quantize_groups(x, w.group):
    the sums and order of this module's docstring over 4-bit weights (the C call also takes the
    values' offset: signed q, or unsigned with minimums)."""
    return _group_gemm(x, w, bias, w._dll.gemm_w4a8, w.offset)


def gemm_w8a8g(x: torch.Tensor, w: PackedInt8GroupWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (any row stride) -> float32 [M, N], (qx, sx) = quantize_groups(x, w.group):
    the sums and order of this module's docstring over 8-bit weights."""
    return _group_gemm(x, w, bias, w._dll.gemm_w8a8g)
