/* float32 -> bf16 rounding of the activations the bf16 dot kernels multiply (gemm_bf16.c's "dot",
 * gemm_fp8.c, gemm_amx.c): torch's rule, so that a kernel's inputs are the bf16 values torch's
 * .to(torch.bfloat16) would give. Nearest even; a NaN stays a (quiet) NaN.
 *
 * The rows are rounded on every GEMM call, so the loop is written for vectors: a scalar loop with
 * the NaN branch took ~1.7 cycles per value, about 5 % of a bf16 W1 run (perf), against ~23 cycles
 * of the GEMM that reads it. Integer arithmetic, not vcvtne2ps2bf16: the instruction flushes
 * denormal inputs to zero, the bits here are torch's exactly. */
#ifndef NORIA_BF16_ROUND_H
#define NORIA_BF16_ROUND_H

#include <stdint.h>
#include <string.h>

static inline uint32_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

typedef uint32_t bf16r_u32 __attribute__((vector_size(64)));
typedef uint16_t bf16r_u16 __attribute__((vector_size(32)));

/* n floats of src as bf16 pairs in dst ((n + 1) / 2 words): value k in the low half of word k / 2
 * when k is even (little-endian: the bf16 values in order), an odd n's last word padded with 0. */
static inline void round_pairs(const float *src, uint32_t *dst, int64_t n) {
    char *out = (char *)dst;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        bf16r_u32 u;
        memcpy(&u, src + k, sizeof u);
        const bf16r_u32 nan = (bf16r_u32)((u & 0x7fffffffu) > 0x7f800000u);
        const bf16r_u32 r = ((u >> 16) | 0x40u) & nan | ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan;
        const bf16r_u16 h = __builtin_convertvector(r, bf16r_u16);
        memcpy(out + 2 * k, &h, sizeof h);
    }
    for (; k < n; k++) {
        const uint16_t h = (uint16_t)to_bf16(src[k]);
        memcpy(out + 2 * k, &h, sizeof h);
    }
    if (n % 2) memset(out + 2 * n, 0, 2);
}

#endif
