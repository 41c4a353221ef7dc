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

The types llama-quantize mixes in where a row is not a multiple of 256 (Q5_0 for Q4_K, Q5_1 for
Q5_K, Q8_0 for Q6_K, IQ4_NL for Q2_K / Q3_K) and the other K-quants:

  Q4_1   20 bytes / 32 values: f16 d, f16 m, 16 bytes of nibbles as Q4_0; w = d * q + m
  Q5_0   22 bytes / 32 values: f16 d, 4 bytes of fifth bits (bit i: value i), nibbles as Q4_0, q - 16
  Q5_1   24 bytes / 32 values: f16 d, f16 m, then as Q5_0 unsigned; w = d * q + m
  IQ4_NL 18 bytes / 32 values: f16 d, nibbles as Q4_0 indexing a fixed table of 16 int8 values
  Q5_K  176 bytes / 256 values: as Q4_K, with 32 bytes of fifth bits (bit j of byte l: value
        32j + l) between the scales and the nibbles
  Q3_K  110 bytes / 256 values: 32 bytes of high bits (hmask), 64 bytes of 2-bit lows, 12 bytes of
        sixteen 6-bit scales (stored + 32), f16 d; q = low - 4 where the high bit is clear
  Q2_K   84 bytes / 256 values: 16 bytes of 4-bit (scale, minimum) pairs, 64 bytes of 2-bit values,
        f16 d, f16 dmin; w = (d * sc) * q - dmin * m per 16 values

Q4_1 and Q5_1 add their minimum; it is returned negated (exact), so every type with one has
QuantLinear's w = q * scale - min.
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


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-value block's 16 bytes of nibbles: low nibbles values 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Four little-endian bytes per block, bit i the fifth bit of value i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def q4_1(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 20)
    q = _nibbles(b[..., 4:]).astype(np.int8)
    return q.reshape(rows, -1), _f16(b[..., 0:2])[..., 0], -_f16(b[..., 2:4])[..., 0]


def q5_0(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 22)
    q = (_nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)).astype(np.int8) - 16
    return q.reshape(rows, -1), _f16(b[..., 0:2])[..., 0], None


def q5_1(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 24)
    q = (_nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)).astype(np.int8)
    return q.reshape(rows, -1), _f16(b[..., 0:2])[..., 0], -_f16(b[..., 2:4])[..., 0]


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def iq4_nl(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 18)
    return IQ4_NL_VALUES[_nibbles(b[..., 2:])].reshape(rows, -1), _f16(b[..., :2])[..., 0], None


def q5_k(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k4_scale_min(b[..., 4:16])
    qs = b[..., 48:].reshape(rows, -1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(rows, -1, 8, 32)
    high = (b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = (low | (high << 4)).astype(np.int8)
    return q.reshape(rows, -1), (d * sc).reshape(rows, -1), (dmin * m).reshape(rows, -1)


def q3_k(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 110)
    s = b[..., 96:108]
    # Scale i: a low nibble (byte i % 8, the high nibble for i >= 8) and 2 high bits (byte 8 +
    # i % 4, bits 2 * (i // 4)).
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    high = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).swapaxes(-1, -2).reshape(*s.shape[:-1], 16)
    sc = ((low | ((high & 3) << 4)).astype(np.int16) - 32).astype(np.float32)
    # Values: 2 chunks of 128, each 32 bytes whose 2-bit fields (shift 0, 2, 4, 6) are 4 runs of
    # 32; the high bit of value 32j + l is bit j of hmask byte l.
    lo = (b[..., 32:96].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    hi = (b[..., 0:32].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = lo.reshape(rows, -1, 8, 32).astype(np.int8) - ((hi ^ 1) << 2).astype(np.int8)
    return q.reshape(rows, -1), (_f16(b[..., 108:110]) * sc).reshape(rows, -1), None


def q2_k(data: np.ndarray, rows: int) -> Decoded:
    b = data.reshape(rows, -1, 84)
    s = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = (b[..., 16:80].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    scales = d * (s & 0x0F).astype(np.float32)
    mins = dmin * (s >> 4).astype(np.float32)
    return q.astype(np.int8).reshape(rows, -1), scales.reshape(rows, -1), mins.reshape(rows, -1)


DECODERS: dict[str, Callable[[np.ndarray, int], Decoded]] = {
    "Q8_0": q8_0, "Q4_0": q4_0, "Q4_K": q4_k, "Q6_K": q6_k, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
    "IQ4_NL": iq4_nl, "Q5_K": q5_k, "Q3_K": q3_k, "Q2_K": q2_k}
