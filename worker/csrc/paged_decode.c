/* Paged decode attention for the CPU torch backend.
 *
 * One query token per sequence attends to its context through the block
 * table, reading K/V in place from the paged cache: no gathered copy. One
 * task per (sequence, KV head); the query heads of its GQA group share every
 * K/V read. Decode is bound by memory bandwidth, so each K/V row is read
 * once, in one pass: tiles of up to TILE tokens inside one block are scored,
 * folded into a running (online) softmax, and their V rows accumulated while
 * the tile's K rows were just read. Scores are float32; exp is a polynomial
 * that vectorises over a tile (libm's expf is a scalar call per score, about
 * a fifth of the kernel's time); the 1/sum normalisation is applied once at
 * the end.
 *
 * q:           [B, H, D]                float32
 * k/v cache:   [NB, BS, KVH, D]         float32
 * block_table: [B, max_blocks]          int64
 * seq_lens:    [B]                      int64
 * out:         [B, H, D]                float32
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define TILE 16

/* exp(x) for x <= 0 (scores minus their running max), Cephes-style: x = n ln2 + r
 * with |r| <= ln2/2, a degree-6 polynomial for e^r, and 2^n built in the
 * exponent bits. Relative error about 2e-7; plain float code, so it vectorises. */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x; /* also maps -inf (first tile's max) to ~1e-38 */
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return e * two_n.f;
}

/* Inlined into each call site below, so where the caller passes a literal head
 * size the compiler sees a constant D and keeps the dot products and V rows in
 * vector registers; the generic call serves any other size. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t start, int64_t len,
    int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t group, const int64_t D, float scale,
    float *out) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][TILE];
    for (int64_t i = 0; i < group * D; i++) qs[i] = q[i] * scale;
    memset(acc, 0, sizeof(float) * (size_t)(group * D));
    for (int64_t g = 0; g < group; g++) m[g] = -INFINITY, l[g] = 0.f;
    for (int64_t pos = start; pos < len;) {
        const int64_t off = pos % block_size;
        int64_t n = block_size - off;
        if (n > len - pos) n = len - pos;
        if (n > TILE) n = TILE;
        const int64_t base = table[pos / block_size] * block_stride + off * token_stride;
        const float *kb = k_cache + base, *vb = v_cache + base;
        for (int64_t t = 0; t < n; t++) {
            const float *kp = kb + t * token_stride;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qs + g * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
                s[g][t] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
            const float corr = exp_neg(m[g] - mx); /* ~0 on the first tile: m = -inf */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                s[g][t] = exp_neg(s[g][t] - mx);
                sum += s[g][t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mx;
            if (corr != 1.f)
                for (int64_t d = 0; d < D; d++) acc[g * D + d] *= corr;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *vp = vb + t * token_stride;
            for (int64_t g = 0; g < group; g++) {
                const float p = s[g][t];
                float *a = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += p * vp[d];
            }
        }
        pos += n;
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

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
        const int64_t *table = block_table + b * max_blocks;
        const float *kc = k_cache + kh * head_dim, *vc = v_cache + kh * head_dim;
        const float *qh = q + (b * num_heads + kh * group) * head_dim;
        float *oh = out + (b * num_heads + kh * group) * head_dim;
#define ATTEND(D) attend(qh, kc, vc, table, start, len, block_size, block_stride, token_stride, group, D, scale, oh)
        if (head_dim == 64)
            ATTEND(64);
        else if (head_dim == 128)
            ATTEND(128);
        else
            ATTEND(head_dim);
#undef ATTEND
    }
}
