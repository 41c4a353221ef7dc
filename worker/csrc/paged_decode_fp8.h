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
 * is NaN, 448 the largest finite. A byte b is exactly the float32 whose bits are
 * ((b & 0x80) << 24) | ((b & 0x7f) << 20), times 2^120, normals and subnormals alike. The
 * product is not built with a float multiply: under -fassociative-math the compiler may move a
 * constant factor across the dot product ((q * x) * 2^120), where q * x underflows, and DAZ would
 * zero the float32 subnormals x. So the 2^120 goes into the exponent field (an integer add, exact
 * for the normals), and a subnormal's lane is renormalised as f16_widen_bits does: exponent 1
 * instead of 0, minus 2^-6, an exact float32 normal. NaN stays NaN. */
#define FP8_EXP (0x78u << 20)    /* an e4m3 exponent field, where a float32's low exponent bits sit */
#define FP8_MAX_BITS 0x43e00000u /* 448.0f */
static inline float fp8_widen_bits(uint8_t b) {
    uint32_t o = (uint32_t)(b & 0x7fu) << 20;
    float f;
    if ((b & 0x7fu) == 0x7fu) {
        o = 0x7fc00000u;
    } else if ((o & FP8_EXP) == 0) { /* m * 2^-9 = (1 + m / 8) * 2^-6 - 2^-6 */
        o += 121u << 23;
        memcpy(&f, &o, sizeof f);
        f -= 0x1p-6f;
        memcpy(&o, &f, sizeof o);
    } else {
        o += 120u << 23;
    }
    o |= (uint32_t)(b & 0x80u) << 24;
    memcpy(&f, &o, sizeof f);
    return f;
}

static inline vf fp8_widen_vec(const uint8_t *p) {
    const vu h = __builtin_convertvector(*(const vb8 *)p, vu);
    vu o = (h & 0x7fu) << 20;
    const vu tiny = (vu)((o & FP8_EXP) == 0), nan = (vu)((h & 0x7fu) == 0x7fu);
    o += 120u << 23;
    const vu renormal = (vu)((vf)(o + (1u << 23)) - 0x1p-6f); /* as fp8_widen_bits */
    o = (tiny & renormal) | (~tiny & o) | (nan & 0x7fc00000u);
    return (vf)(o | (h & 0x80u) << 24);
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
    /* A subnormal in units of 2^-9: the 24-bit significand shifted right by 141 - exponent (21..23). */
    const uint32_t shift = 141u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (uint8_t)(q + (rest > half || (rest == half && (q & 1u)))); /* 8: up to 2^-6 */
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
