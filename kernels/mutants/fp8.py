"""Mutants of the fp8 (e4m3) KV cache: the conversions of csrc/fp8.cuh (the cache write's
saturation and rounding, the read's exponent rebias) and the scales the tensor-core decode and
prefill kernels fold into the softmax scale and the output."""

from __future__ import annotations

from noria.kernels.mutants.mutant import TESTS, Mutant

_FP8 = str(TESTS / "test_attention_fp8.py")
_WRITE_TESTS = (_FP8 + "::test_cache_write_quantizes_as_the_torch_path",)
_DECODE_TESTS = (_FP8 + "::test_fp8_decode_matches_reference",)
_PREFILL_TESTS = (_FP8 + "::test_fp8_prefill_matches_reference",)
_READ_TESTS = (_FP8 + "::test_every_e4m3_byte_widens_exactly", *_DECODE_TESTS)
_BF16 = "bfloat16"  # the write tests' and the smaller attention configuration's id
_ATT = "bfloat16-d64-b16"

FP8: tuple[Mutant, ...] = (
    Mutant(
        "fp8-write-no-saturation",
        "no saturation on the fp8 cache write (values past 448 overflow into NaN and the sign)",
        "fp8.cuh",
        "  if (a >= kFp8Max) return static_cast<fp8_e4m3>(sign | 0x7eu);\n",
        "",
        _WRITE_TESTS,
        keyword=_BF16,
    ),
    Mutant(
        "fp8-write-truncates",
        "wrong rounding on the fp8 cache write (mantissa truncated, not rounded to nearest even)",
        "fp8.cuh",
        "  u += 0x7ffffu + ((u >> 20) & 1u);\n",
        "",
        _WRITE_TESTS,
        keyword=_BF16,
    ),
    Mutant(
        "fp8-read-wrong-rebias",
        "wrong exponent rebias on the fp8 cache read (2^7 for e4m3 -> fp16's 2^8)",
        "fp8.cuh",
        "constexpr float kFp8Rebias = 256.0f;",
        "constexpr float kFp8Rebias = 128.0f;",
        _READ_TESTS,
        keyword=_ATT,
    ),
    Mutant(
        "fp8-decode-k-scale-dropped",
        "K scale dropped (GQA decode: the softmax scale without the fp8 cache's k_scale)",
        "decode_attention_gqa.cu",
        "  scale *= k_scale;  // q . (fp8 * k_scale) = k_scale * (q . fp8)\n",
        "",
        _DECODE_TESTS,
        keyword=_ATT,
    ),
    Mutant(
        "fp8-decode-v-scale-dropped",
        "V scale dropped (GQA decode: the output without the fp8 cache's v_scale)",
        "decode_attention_gqa.cu",
        "const float inv = l > 0.0f ? v_scale / l : 0.0f;",
        "const float inv = l > 0.0f ? 1.0f / l : 0.0f;",
        _DECODE_TESTS,
        keyword=_ATT,
    ),
    Mutant(
        "fp8-prefill-k-scale-dropped",
        "K scale dropped (tensor-core prefill: the softmax scale without k_scale)",
        "prefill_attention_tc.cu",
        "  scale *= k_scale;  // q . (fp8 * k_scale) = k_scale * (q . fp8)\n",
        "",
        _PREFILL_TESTS,
        keyword=_ATT,
    ),
    Mutant(
        "fp8-prefill-v-scale-dropped",
        "V scale dropped (tensor-core prefill: the output without v_scale)",
        "prefill_attention_tc.cu",
        "const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;",
        "const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;",
        _PREFILL_TESTS,
        keyword=_ATT,
    ),
)
