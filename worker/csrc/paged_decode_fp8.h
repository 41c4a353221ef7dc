/* The fp8 e4m3 KV cache of paged_decode.c (--kv-cache-dtype fp8, float8_e4m3fn): how a cache byte
 * widens to float32, how a new row's float32 rounds to a byte, and the entry points, which take
 * the layer's K and V scales (a cache stores x / scale, saturated to +-448 as vLLM's cache writes
 * saturate, __NV_SATFINITE). Everything else (tiles, softmax, split-K) is the generic kernel's,
 * specialised for KV_FP8.
 *
 * Part of paged_decode.c, not a header for other files: paged_decode.c includes it once, at its end, after its vector types
 * (vf, vu, vb8), its element types and paged_decode(), and declares the three element functions
 * before its kernels use them. worker/native_build.py keys the built library by this file too.
 */
#ifndef PAGED_DECODE_FP8_H
#define PAGED_DECODE_FP8_H

/* fp8 e4m3 (float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111
 * is NaN, 448 the largest finite.
 *
 * A cache element widens to its value times 2^-8 (1 / FP8_UNIT), which is the IEEE half with bits
 * ((b & 0x80) << 8) | ((b & 0x7f) << 7), normals and subnormals alike: half's exponent field is one
 * bit wider with bias 15, 2^(15 - 7) apart, and a subnormal m * 2^-9 is the subnormal half
 * m * 2^-17 (worker/csrc/gemm_fp8.c reads its weights the same way). Where F16C or AVX-512F is
 * built in that is a sign extension, a shift, a mask and one vcvtph2ps per vector, exact (every
 * half is a float32 normal: DAZ/FTZ cannot touch it), instead of exponent arithmetic and a
 * renormalised subnormal per lane. The NaN bytes S.1111.111 would be the halves +-1.875
 * (S.01111.1110000000): the top exponent bit is set in their lanes, which makes them the NaNs
 * S.11111.1110000000, float32 0x7ff00000 with the sign, the NaN the portable vector code makes,
 * so a NaN in the cache still poisons what reads it.
 *
 * The 2^-8 is never undone by a float multiply on the widened values: under -fassociative-math
 * (worker/cpu_kernels.py's flags) the compiler may regroup q * (x * 2^8) as (q * x) * 2^8, where
 * q * x can underflow. attend() (paged_decode.c) folds 2^8 into what multiplies the widened
 * values instead, exactly: the scaled queries (q * scale, rounded as for every other type, then
 * times 2^8 behind a compiler barrier) and the softmax weights of V (each a float32 normal in
 * (2^-126, 1], so times 2^8 is exact in any grouping). Each product is then the same real number
 * as (q * scale) * k and p * v, rounded once as before: scores, sums and outputs are the same bits
 * as widening to the values themselves. */
#define FP8_EXP (0x78u << 20)    /* an e4m3 exponent field, where a float32's low exponent bits sit */
#define FP8_MAX_BITS 0x43e00000u /* 448.0f */
static inline float fp8_widen_bits(uint8_t b) {
    uint32_t o = (uint32_t)(b & 0x7fu) << 20;
    float f;
    if ((b & 0x7fu) == 0x7fu) {
        o = 0x7fc00000u;
    } else if ((o & FP8_EXP) == 0) { /* m * 2^-17 = (1 + m / 8) * 2^-14 - 2^-14, a float32 normal */
        o += 113u << 23;
        memcpy(&f, &o, sizeof f);
        f -= 0x1p-14f;
        memcpy(&o, &f, sizeof o);
    } else {
        o += 112u << 23; /* exponent e - 7 - 8, rebiased to float32's 127 */
    }
    o |= (uint32_t)(b & 0x80u) << 24;
    memcpy(&f, &o, sizeof f);
    return f;
}

static inline vf fp8_widen_vec(const uint8_t *p) {
#if FP8_VCVT && VW == 16
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16((short)0xBF80));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(h, _mm256_set1_epi16((short)0x8000)),
                                           _mm256_set1_epi16((short)0xBF80));
    return (vf)_mm512_cvtph_ps(_mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000))));
#elif FP8_VCVT
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16((short)0xBF80));
    const __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(h, _mm_set1_epi16((short)0x8000)), _mm_set1_epi16((short)0xBF80));
    return (vf)_mm256_cvtph_ps(_mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x4000))));
#else
    const vu h = __builtin_convertvector(*(const vb8 *)p, vu);
    vu o = (h & 0x7fu) << 20;
    const vu tiny = (vu)((o & FP8_EXP) == 0), nan = (vu)((h & 0x7fu) == 0x7fu);
    o += 112u << 23;
    const vu renormal = (vu)((vf)(o + (1u << 23)) - 0x1p-14f); /* as fp8_widen_bits */
    o = (tiny & renormal) | (~tiny & o) | (nan & 0x7fc00000u);
    return (vf)(o | (h & 0x80u) << 24);
#endif
}

/* float32 -> fp8 e4m3 to nearest even, integers only (no MXCSR), saturating: a finite value or an
 * infinity past 448 becomes +-448 (vLLM's cache write, __NV_SATFINITE), a NaN the NaN S.1111.111. */
static inline uint8_t to_fp8(float x) {
    uint32_t a;
    memcpy(&a, &x, sizeof a);
    const uint8_t sign = (uint8_t)((a >> 24) & 0x80u);
    a &= 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a >= FP8_MAX_BITS) return sign | 0x7eu;
    if (a >= 121u << 23) { /* >= 2^-6: a normal e4m3; rounding 448 - ulp up stays 448 */
        a -= 120u << 23;
        return sign | (uint8_t)((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20);
    }
    if (a <= 117u << 23) return sign; /* <= 2^-10, half the smallest subnormal: a tie to even 0 */
    /* A subnormal in units of 2^-9: the 24-bit significand shifted right by 141 - exponent (21..24). */
    const uint32_t shift = 141u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (uint8_t)(q + (rest > half || (rest == half && (q & 1u)))); /* 8: up to 2^-6 */
}

/* A row of float32 / scale -> fp8, VW values at a time where vector shifts by a count per lane
 * exist (AVX2: vpsrlvd, vpsllvd), the tail and other builds by to_fp8. The same steps as to_fp8,
 * every case computed in every lane and the right one selected; the division is IEEE's in any
 * vector width, so the bytes are to_fp8's. A prefill step writes every prompt token's K and V
 * rows: one value at a time, to_fp8's branches took ~8 ms of a 2,048-token step's 26 ms per
 * layer (12 x 64 values per row; vectorised, ~2 ms). */
static void to_fp8_row(uint8_t *dst, const float *row, int64_t n, float scale) {
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + VW <= n; j += VW) {
        const vf x = *(const vfu *)(row + j) / scale;
        const vu bits = (vu)x, a = bits & 0x7fffffffu, sign = (bits >> 24) & 0x80u;
        const vu an = a - (120u << 23); /* a normal e4m3, rebiased; rounding 448 - ulp up stays 448 */
        const vu normal = (an + 0x7ffffu + ((an >> 20) & 1u)) >> 20;
        /* A subnormal: exponents 117..120 (others clamped there, their lanes not selected). */
        const vu e = a >> 23, low = (vu)(e < 117u), high = (vu)(e > 120u);
        const vu shift = 141u - ((low & 117u) | (high & 120u) | (~(low | high) & e)), m = (a & 0x7fffffu) | 0x800000u;
        const vu q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        const vu up = (vu)(rest > half) | ((vu)(rest == half) & (vu)((q & 1u) != 0)); /* all ones: round up */
        const vu sub = q - up;
        const vu nan = (vu)(a > 0x7f800000u), big = (vu)(a >= FP8_MAX_BITS) & ~nan;
        const vu is_normal = (vu)(a >= 121u << 23) & ~(nan | big), is_sub = (vu)(a > 117u << 23) & (vu)(a < 121u << 23);
        const vu r = (nan & 0x7fu) | (big & 0x7eu) | (is_normal & normal) | (is_sub & sub);
        *(vb8 *)(dst + j) = __builtin_convertvector(r | sign, vb8);
    }
#endif
    for (; j < n; j++) dst[j] = to_fp8(row[j] / scale);
}

/* The fp8 entry points. decoder_f32.c calls the capped one through a pointer (its attn_scaled),
 * with cap 0 for none, since each layer has scales of its own. */
int paged_decode_capped_fp8(PAGED_DECODE_PARAMS(uint8_t), float cap, float k_scale, float v_scale) {
    return paged_decode(PAGED_DECODE_ARGS, cap, KV_FP8, k_scale, v_scale);
}

int paged_decode_fp8(PAGED_DECODE_PARAMS(uint8_t), float k_scale, float v_scale) {
    return paged_decode(PAGED_DECODE_ARGS, 0.f, KV_FP8, k_scale, v_scale);
}

#endif
