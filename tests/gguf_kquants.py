"""Blocks the gguf package cannot quantize (Q5_K, Q3_K, Q2_K, IQ4_NL), packed from ggml's layouts.

A simple range quantizer per sub-block, nothing like llama-quantize's search: the tests need
valid blocks with every field used, not good ones. Each packer is checked against the gguf
package's dequantizer (tests/test_gguf_types.py), which is the reading transformers uses too.
"""

from __future__ import annotations

import numpy as np

from noria.worker.gguf_blocks import IQ4_NL_VALUES


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as f16 bytes [..., 2], and its float32 value [..., 1]."""
    h = x.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)[..., None]


def _range_6bit(g: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per sub-block of g [rows, blocks, subs, n]: 6-bit sc and m of the block's d and dmin, and
    values q in [0, levels] with w ~ d * sc * q - dmin * m."""
    mn = np.maximum(-g.min(-1), 0)
    scale = (g.max(-1) + mn) / levels
    d_bytes, df = _f16(scale.max(-1) / 63)
    dmin_bytes, dminf = _f16(mn.max(-1) / 63)
    sc = np.clip(np.rint(_div(scale, df)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mn, dminf)), 0, 63).astype(np.uint8)
    q = np.rint(_div(g + (dminf * m)[..., None], (df * sc)[..., None]))
    return d_bytes, dmin_bytes, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit (sc, m) pairs in Q4_K's / Q5_K's 12 bytes."""
    return np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                           (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)


def _crumbs(u: np.ndarray) -> np.ndarray:
    """2-bit values [rows, blocks, 256] as Q2_K / Q3_K store them: per 128 values 32 bytes, value
    32s + l of the chunk in bits 2s of byte l."""
    u = u.reshape(*u.shape[:-1], 2, 4, 32)
    out = u[..., 0, :] | (u[..., 1, :] << 2) | (u[..., 2, :] << 4) | (u[..., 3, :] << 6)
    return out.reshape(*u.shape[:-3], 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """One bit per value [rows, blocks, 256]: value 32j + l as bit j of byte l (32 bytes)."""
    planes = bits.reshape(*bits.shape[:-1], 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(planes << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=-2)


def pack_q5_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    g = w.reshape(rows, -1, 8, 32).astype(np.float32)
    d, dmin, sc, m, q = _range_6bit(g, 31)
    q = q.reshape(rows, -1, 256)
    low = (q & 0x0F).reshape(rows, -1, 4, 2, 32)  # 4 chunks of 64: low nibbles the first 32
    qs = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(rows, -1, 128)
    return np.concatenate([d, dmin, _k4_scales(sc, m), _bit_planes(q >> 4), qs], axis=-1).reshape(rows, -1)


def pack_q3_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    g = w.reshape(rows, -1, 16, 16).astype(np.float32)
    # The value of largest magnitude maps to -4 (Q5_0's rule), the end of [-4, 3] with room.
    scale = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0] / -4
    d, df = _f16(np.abs(scale).max(-1) / 31)
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -32, 31)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(g, step, out=np.zeros_like(g), where=step != 0)), -4, 3)
    u = (q + 4).astype(np.uint8).reshape(rows, -1, 256)
    s = (sc + 32).astype(np.uint8)
    low = (s[..., :8] & 0x0F) | ((s[..., 8:] & 0x0F) << 4)
    hi = (s >> 4).reshape(rows, -1, 4, 4)  # scale 4k + i's top bits: byte 8 + i, bits 2k
    high = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    return np.concatenate([_bit_planes(u >> 2), _crumbs(u & 3), low, high, d], axis=-1).reshape(rows, -1)


def pack_q2_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    g = w.reshape(rows, -1, 16, 16).astype(np.float32)
    mn = np.maximum(-g.min(-1), 0)
    scale = (g.max(-1) + mn) / 3
    d, df = _f16(scale.max(-1) / 15)
    dmin, dminf = _f16(mn.max(-1) / 15)
    sc = np.clip(np.rint(_div(scale, df)), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(_div(mn, dminf)), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(_div(g + (dminf * m)[..., None], (df * sc)[..., None])), 0, 3).astype(np.uint8)
    return np.concatenate([sc | (m << 4), _crumbs(q.reshape(rows, -1, 256)), d, dmin], axis=-1).reshape(rows, -1)


def pack_iq4_nl(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    g = w.reshape(rows, -1, 32).astype(np.float32)
    d, df = _f16(np.abs(g).max(-1) / 127)
    x = _div(g, df)
    idx = np.abs(x[..., None] - IQ4_NL_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)
    return np.concatenate([d, idx[..., :16] | (idx[..., 16:] << 4)], axis=-1).reshape(rows, -1)


PACKERS = {"Q5_K": pack_q5_k, "Q3_K": pack_q3_k, "Q2_K": pack_q2_k, "IQ4_NL": pack_iq4_nl}
