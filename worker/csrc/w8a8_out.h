/* One row of W8A8 outputs from its int32 sums, shared by gemm_quant.c's vpdpbusd
 * tiles and gemm_amx.c's AMX-INT8 ones so that both give the same bits:
 *     out[j] = (float)(sum[j] - corr[j]) * s * sw[j] (+ bias[j])
 * sum - corr wraps back to the exact sum of the signed products (gemm_quant.c's
 * top comment); the scales, then the bias. n is a literal at every call. */
#ifndef NORIA_W8A8_OUT_H
#define NORIA_W8A8_OUT_H
#include <stdint.h>

static inline __attribute__((always_inline)) void w8a8_out(const int32_t *sums, const int32_t *corr, float s,
                                                           const float *sw, const float *bias, float *out,
                                                           const int64_t n) {
    if (bias != NULL)
        for (int64_t j = 0; j < n; j++) out[j] = (float)(int32_t)((uint32_t)sums[j] - (uint32_t)corr[j]) * s * sw[j] + bias[j];
    else
        for (int64_t j = 0; j < n; j++) out[j] = (float)(int32_t)((uint32_t)sums[j] - (uint32_t)corr[j]) * s * sw[j];
}
#endif
