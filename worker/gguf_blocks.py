"""GGUF's quantized blocks as integer values, float32 scales and minimums, vectorized over blocks.

Written from ggml's block layouts (the block structs of ggml-common and dequantize_row_* of
ggml-quants); the tests check them against the gguf package's own dequantizer. Each decoder
takes a tensor's bytes as [rows, bytes per row] and returns values [rows, K] as int8, scales
[rows, K / group] and, for the types with one, minimums of the same shape, all in float32
exactly (protocol/gguf_quant.py):

  Q8_0  34 bytes / 32 values: f16 d, int8 q[32]
  Q4_0  18 bytes / 32 values: f16 d, 16 bytes of nibbles (low: values 0-15, high: 16-31), q - 8
  Q4_K 144 bytes / 256 values: f16 d, f16 dmin, 12 bytes of eight 6-bit (sc, m) pairs,
        128 bytes of nibbles: 32 bytes per 64 values, low nibbles the first 32, high the next
  Q6_K 210 bytes / 256 values: 128 bytes of low nibbles (ql), 64 bytes of 2-bit highs (qh),
        16 int8 sub-scales, f16 d; per 128 values, 64 bytes of ql and 32 of qh
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def q8_0(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 34)
    return b[..., 2:].copy().view(np.int8).reshape(rows, -1), _f16(b[..., :2])[..., 0], None


def q4_0(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 18)
    qs = b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    return q.reshape(rows, -1), _f16(b[..., :2])[..., 0], None


def _k4_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight 6-bit scales and minimums from 12 bytes (ggml's get_scale_min_k4): sub-blocks 0-3 in
    the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, with their
    top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def q4_k(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k4_scale_min(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 chunks of 64 values, 32 bytes each
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).astype(np.int8)  # [.., chunk, low/high, 32]
    return q.reshape(rows, -1), (d * sc).reshape(rows, -1), (dmin * m).reshape(rows, -1)


def q6_k(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 210)
    ql = b[..., 0:128].reshape(rows, -1, 2, 1, 2, 32)  # half, -, ql part (bytes 0-31 / 32-63), l
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)  # half, -, l
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # Quarter j of a half (values 32j..32j+31): nibble j // 2 (low, high) of ql part j % 2, and
    # bits 2j, 2j+1 of qh.
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-3).reshape(rows, -1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    return q.reshape(rows, -1), (d * sc).reshape(rows, -1), None


DECODERS: dict[str, Callable[[np.ndarray, int], Decoded]] = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_K": q4_k, "Q6_K": q6_k}
