"""Which kernel gemm_quant.c's W8A8 GEMM runs on: AMX-INT8 tiles (worker/csrc/gemm_amx.c's
gemm_amx_w8a8_range) from W8A8_TILE_ROWS rows where the CPU has them and they pass a self-check
at load, else vpdpbusd; the same sums either way. worker/gemm_quant_kernels.py's load() calls
`choose_w8a8`."""

from __future__ import annotations

import ctypes

import torch

from noria.protocol import switches
from noria.worker import gemm_amx_kernels, gemm_quant_kernels

# From this many rows gemm_w8a8 runs on AMX-INT8 tiles where they are chosen: below it a call reads
# its weights from memory either way, and vpdpbusd's registers need no tile set-up.
W8A8_TILE_ROWS = 8
_w8a8_tiles: list[int | None] = [None, W8A8_TILE_ROWS]  # what gemm_w8a8 was last given


def set_w8a8_tiles(address: int | None, min_rows: int = W8A8_TILE_ROWS) -> bool:
    """Give gemm_w8a8 the tile kernel at `address` (gemm_amx_kernels.w8a8_tiles_address) for calls of
    at least `min_rows` rows, or None: vpdpbusd always. False (and nothing changed) where this build's
    W8A8 panels are not the tiles' layout (only the 512-bit VNNI build's are)."""
    if gemm_quant_kernels._dll().gemm_quant_set_w8a8_tiles(address, min_rows) != 0:
        return False
    _w8a8_tiles[:] = [address, min_rows]
    return True


def w8a8_tiles() -> tuple[int | None, int]:
    """(the tile kernel's address or None, its minimum rows): what gemm_w8a8 runs on now."""
    return _w8a8_tiles[0], int(_w8a8_tiles[1] or 0)


def choose_w8a8(dll: ctypes.CDLL) -> None:
    """At load: AMX-INT8 tiles for W8A8 where they are usable, NORIA_CPU_NO_AMX is not set, and on a
    ragged product (every edge: rows, features and k off the tiles' sizes, a bias) they give the
    vpdpbusd kernel's bits; else vpdpbusd."""
    address = None if switches.cpu_no_amx() else gemm_amx_kernels.w8a8_tiles_address(emulate=False)
    if address is None or dll.gemm_quant_set_w8a8_tiles(address, 1) != 0:
        return
    g = torch.Generator().manual_seed(0)
    n, k, m = 100, 300, 37
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    data, corr = gemm_quant_kernels._pack_int8(q, int(dll.gemm_quant_i8_nr()), int(dll.gemm_quant_i8_shift()))
    scale = torch.rand(data.shape[0] * data.shape[2], generator=g) / 64
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    out = []
    for tiles in (address, None):
        dll.gemm_quant_set_w8a8_tiles(tiles, 1)
        y = torch.empty(m, n)
        dll.gemm_w8a8(x.data_ptr(), k, data.data_ptr(), corr.data_ptr(), scale.data_ptr(), bias.data_ptr(),
                      y.data_ptr(), n, m, n, k, torch.get_num_threads())
        out.append(y)
    if torch.equal(out[0], out[1]):
        dll.gemm_quant_set_w8a8_tiles(address, W8A8_TILE_ROWS)
        _w8a8_tiles[:] = [address, W8A8_TILE_ROWS]
