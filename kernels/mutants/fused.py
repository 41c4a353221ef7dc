"""Mutants of a decoder layer's fused elementwise kernels (fused_ops.cu): add + RMSNorm,
rotary + KV-cache write, SiLU-and-mul."""

from __future__ import annotations

from noria.kernels.mutants.mutant import TESTS, Mutant

_FUSED = str(TESTS / "test_fused_ops.py")
_NORM_TESTS = (_FUSED + "::test_add_rms_norm",)
_ROTARY_TESTS = (_FUSED + "::test_rotary_qkv_cache",)
_SILU_TESTS = (_FUSED + "::test_silu_and_mul",)
# float32 (the tightest tolerance); for the norm, rows over 8 warps of 16-byte accesses.
_NORM_KEYWORD = "3x1024s1024 and float32"

FUSED: tuple[Mutant, ...] = (
    Mutant(
        "norm-no-reduce-barrier",
        "removed `__syncthreads` (RMSNorm: warp sums read before every warp wrote its own)",
        "fused_ops.cu",
        "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  float r = 0.f;",
        "  if (lane == 0) scratch[warp] = v;\n  float r = 0.f;",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "norm-sum-first-warp",
        "reduction one level short (RMSNorm: the first warp's sum of squares only)",
        "fused_ops.cu",
        "for (int w = 0; w < num_warps; ++w) r += scratch[w];",
        "for (int w = 0; w < 1; ++w) r += scratch[w];",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "norm-residual-not-stored",
        "dropped store (the residual stream keeps its old value)",
        "fused_ops.cu",
        "      store_pack<T, kVec>(rr + i * kVec, a);\n",
        "",
        _NORM_TESTS,
        keyword="residual and float32",
    ),
    Mutant(
        "norm-mean-over-vectors",
        "wrong RMSNorm mean (divided by the 16-byte vector count, not the hidden size)",
        "fused_ops.cu",
        "rsqrtf(block_sum_any(sum_sq, scratch) / hidden + eps)",
        "rsqrtf(block_sum_any(sum_sq, scratch) / num_vecs + eps)",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "rotary-sign",
        "wrong rotary sign (second half rotated the wrong way)",
        "fused_ops.cu",
        "rounded<T>(__fmul_rn(x2, cf)) + rounded<T>(__fmul_rn(x1, sf))",
        "rounded<T>(__fmul_rn(x2, cf)) - rounded<T>(__fmul_rn(x1, sf))",
        _ROTARY_TESTS,
        keyword="float32 and i64",
    ),
    Mutant(
        "rotary-first-k-head-uncached",
        "off-by-one in the head index (the first k head is not written to the cache)",
        "fused_ops.cu",
        "if (head >= num_heads && slot >= 0) {",
        "if (head > num_heads && slot >= 0) {",
        _ROTARY_TESTS,
        keyword="float32 and i64",
    ),
    Mutant(
        "rotary-partial-k-pass-uncached",
        "dropped store (partial rotary: k's dims past the rotary ones never reach the cache)",
        "fused_ops.cu",
        "    cache_store(k_cache + slot * kv_elems + off, k[off], k_scale);\n",
        "",
        (_FUSED + "::test_rotary_partial_with_scaled_table",),
        keyword="float32",
    ),
    Mutant(
        "silu-past-the-end",
        "off-by-one past the end (SiLU-and-mul: one access past each row)",
        "fused_ops.cu",
        "if (i >= inter / kVec) return;",
        "if (i > inter / kVec) return;",
        _SILU_TESTS,
        keyword="float32",
    ),
    Mutant(
        "silu-sign",
        "wrong activation (x * sigmoid(-x))",
        "fused_ops.cu",
        "x / (1.f + expf(-x))",
        "x / (1.f + expf(x))",
        _SILU_TESTS,
        keyword="float32",
    ),
)
