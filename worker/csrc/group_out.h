/* One row of a quantized group's int32 sums into the float totals, shared by gemm_quant.c's
 * vpdpbusd tiles and gemm_amx.c's AMX-INT8 ones so that both give the same bits (the order is
 * gemm_quant.c's, W4A8 part):
 *     i   = sums[j] - z[j] * xs   (int32, wrapping: the exact sum of qx * (q - zero))
 *     tot = fmaf((float)i * sx, scale[j], tot[j])  (then fmaf(cx, mins[j], tot) with minimums)
 * z[j] = zeros[j] (stored zero points) where zp, else off; less adj (W8G_ADJ). n is a literal. */
#ifndef NORIA_GROUP_OUT_H
#define NORIA_GROUP_OUT_H
#include <math.h>
#include <stdint.h>

static inline __attribute__((always_inline)) void group_out(const int32_t *sums, float *restrict tot, int32_t xs,
                                                            float sx, float cx, const float *scale,
                                                            const uint8_t *zeros, const float *mins, int32_t off,
                                                            const int adj, const int zp, const int mn,
                                                            const int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const int32_t z = (zp ? (int32_t)zeros[j] : off) - adj;
        const int32_t i = (int32_t)((uint32_t)sums[j] - (uint32_t)z * (uint32_t)xs);
        float t = fmaf((float)i * sx, scale[j], tot[j]);
        if (mn) t = fmaf(cx, mins[j], t);
        tot[j] = t;
    }
}
#endif
