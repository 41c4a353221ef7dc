/* Paged decode attention for the CPU torch backend.
 *
 * One query token per sequence attends to its context through the block
 * table, reading K/V in place from the paged cache: no gathered copy. One
 * task per (sequence, KV head); the query heads of its GQA group share every
 * K/V read. Scores are exact (max-subtracted softmax, float32); the 1/sum
 * normalisation is applied once to the output instead of to every score.
 *
 * q:           [B, H, D]                float32
 * k/v cache:   [NB, BS, KVH, D]         float32
 * block_table: [B, max_blocks]          int64
 * seq_lens:    [B]                      int64
 * out:         [B, H, D]                float32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                      const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                      int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, kh = task % num_kv_heads;
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - start;
        const int64_t *table = block_table + b * max_blocks;
        const float *qh = q + (b * num_heads + kh * group) * head_dim;
        float *oh = out + (b * num_heads + kh * group) * head_dim;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (n > 0 ? n : 1)));
        float qs[MAX_GROUP * 256];
        /* Pre-scaled queries: one multiply per element instead of one per score. */
        for (int64_t i = 0; i < group * head_dim; i++) qs[i] = qh[i] * scale;
        float mx[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = start + t;
            const float *kp = k_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride
                              + kh * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qs + g * head_dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qg[d] * kp[d];
                scores[g * n + t] = acc;
                mx[g] = acc > mx[g] ? acc : mx[g];
            }
        }
        float inv[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *s = scores + g * n, sum = 0.f;
            for (int64_t t = 0; t < n; t++) {
                s[t] = expf(s[t] - mx[g]);
                sum += s[t];
            }
            inv[g] = sum > 0.f ? 1.f / sum : 0.f;
        }
        memset(oh, 0, sizeof(float) * (size_t)(group * head_dim));
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = start + t;
            const float *vp = v_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride
                              + kh * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * n + t];
                float *o = oh + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * vp[d];
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < head_dim; d++) oh[g * head_dim + d] *= inv[g];
        free(scores);
    }
}
