"""Mutants of the W4A16 GEMM (gemm_w4a16.cu): the bugs a 4-bit dequant-GEMM gets wrong, from the
packed layout to the epilogue. The tests run in float16 (the tensor-core kernel, where a
running sum rounded to 16 bits is visible); the helpers mutated are shared with the float32
kernel."""

from __future__ import annotations

from noria.kernels.mutants.mutant import TESTS, Mutant

_W4A16_TESTS = (str(TESTS / "test_gemm_w4a16.py") + "::test_gemm_w4a16",)
_KEYWORD = "float16"

GEMM_W4A16: tuple[Mutant, ...] = (
    Mutant(
        "w4a16-nibble-order",
        "wrong nibble order (the eight values read in sequence, not Marlin's pair interleave)",
        "gemm_w4a16.cu",
        "const int lo_shift = 4 * p, hi_shift = 4 * p + 16;",
        "const int lo_shift = 8 * p, hi_shift = 8 * p + 4;",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-scale-wrong-group",
        "scale of the wrong group (the group of the 64-feature word, not of the 16-feature step)",
        "gemm_w4a16.cu",
        "return k0 / group;",
        "return (k0 & ~63) / group;",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-zero-dropped",
        "dropped zero point (asymmetric weights dequantized as symmetric)",
        "gemm_w4a16.cu",
        "& 0xfu) - 8 - zero);",
        "& 0xfu) - 8);",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-tail-columns",
        "missing tail columns (a warp whose 16 columns pass N skips them all)",
        "gemm_w4a16.cu",
        "return n0 < n;",
        "return n0 + kW4TileN <= n;",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-half-accumulator",
        "accumulation in half precision (the running sum rounded to the activation dtype per group)",
        "gemm_w4a16.cu",
        "  return acc + part * scale;",
        "  return to_float(from_float<T>(acc + part * scale));",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-past-k",
        "off-by-one past the end (the activation at K read for the padded tail of a row)",
        "gemm_w4a16.cu",
        "const unsigned lo = col < k ? p[col] : 0u;",
        "const unsigned lo = col <= k ? p[col] : 0u;",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
    Mutant(
        "w4a16-split-dropped",
        "reduction one level short (split-K: the last split's partial sums never added)",
        "gemm_w4a16.cu",
        "for (int z = 0; z < splits; ++z) v += partial[z * total + i];",
        "for (int z = 0; z < splits - 1; ++z) v += partial[z * total + i];",
        _W4A16_TESTS,
        keyword=_KEYWORD,
    ),
)
