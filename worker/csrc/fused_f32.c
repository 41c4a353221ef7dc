/* Fused float32 elementwise steps of a decoder layer for the CPU torch backend.
 *
 * Each replaces 5-15 small torch operators (each a dispatch, an allocation
 * and a pass over memory) with one pass. Compiled with -ffp-contract=off so
 * that every multiply and add rounds on its own, exactly as torch's separate
 * operators do: rotary is bit for bit torch's, and RMSNorm differs from torch
 * only in the order in which the sum of squares is added up.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define VL 8
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static float sum_squares(const float *x, int64_t n) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = *(const vfu *)(x + i);
        acc += v * v;
    }
    float s = 0.f;
    for (int j = 0; j < VL; j++) s += acc[j];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* Per row: h = h + residual (when residual is not NULL; h then holds the new
 * residual stream), out = weight * (h * (1 / sqrt(mean(h^2) + eps))), the
 * operator order of transformers' LlamaRMSNorm in float32. */
void add_rms_norm(float *h, const float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        if (residual != NULL) {
            const float *res = residual + r * n;
            for (int64_t i = 0; i < n; i++) x[i] = x[i] + res[i];
        }
        const float inv = 1.f / sqrtf(sum_squares(x, n) / (float)n + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (x[i] * inv);
    }
}

/* Neox rotary on q and k and the split of a fused qkv row, in one pass:
 * qkv [T, ld] holds q (H heads), k (KVH heads), v (KVH heads) of size D;
 * cos, sin [T, D/2]. q [T, H, D], k and v [T, KVH, D] are written contiguous.
 * Per pair (x1, x2) = (x[i], x[i + D/2]): x1 * c - x2 * s and x2 * c + x1 * s. */
void rope_split_partial(const float *qkv, int64_t ld, const float *cos, const float *sin, float *q, float *k,
                        float *v, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R, int num_threads);

/* Every dim rotates: the partial rotary with R = D (its copy of the unrotated dims is empty). */
void rope_split(const float *qkv, int64_t ld, const float *cos, const float *sin, float *q, float *k, float *v,
                int64_t T, int64_t H, int64_t KVH, int64_t D, int num_threads) {
    rope_split_partial(qkv, ld, cos, sin, q, k, v, T, H, KVH, D, D, num_threads);
}

/* Qwen3's per-head q/k RMSNorm, then rotary and the split, in one pass: as rope_split,
 * but each q head's D values are first normalized and scaled by q_weight [D] (k heads by
 * k_weight) with add_rms_norm's arithmetic, w * (x * (1 / sqrt(mean(x^2) + eps))), the
 * operator order of the norm before the rotary in transformers' Qwen3Attention. */
void qk_norm_rope_split(const float *qkv, int64_t ld, const float *cos, const float *sin, const float *q_weight,
                        const float *k_weight, float eps, float *q, float *k, float *v, int64_t T, int64_t H,
                        int64_t KVH, int64_t D, int num_threads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ld, *c = cos + t * half, *s = sin + t * half;
        float n[D];
        for (int64_t head = 0; head < H + KVH; head++) {
            const float *x = row + head * D, *w = head < H ? q_weight : k_weight;
            float *o = head < H ? q + (t * H + head) * D : k + (t * KVH + head - H) * D;
            const float inv = 1.f / sqrtf(sum_squares(x, D) / (float)D + eps);
            for (int64_t i = 0; i < D; i++) n[i] = w[i] * (x[i] * inv);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = n[i], x2 = n[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
        memcpy(v + t * KVH * D, row + (H + KVH) * D, sizeof(float) * (size_t)(KVH * D));
    }
}

/* e^x, Cephes-style: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r,
 * 2^n built in the exponent bits; relative error about 2e-7 (torch's vectorised exp
 * is within 1 ulp too, so the two differ in the last bit or two). Above 88, +inf, as
 * torch's (so SiLU's x / (1 + e^-x) is -0 for very negative x, NaN for -inf); below
 * -87, e^-87: 1 + e^x is then 1 either way. */
static inline vf exp_v(vf x) {
    const vf hi = (vf){0} + 88.f, lo = (vf){0} - 87.f, shifter = (vf){0} + 12582912.f; /* 1.5 * 2^23 */
    const vi over = x > hi, under = x < lo;
    x = (vf)(((vi)x & ~over) | ((vi)hi & over)); /* a finite x for the arithmetic below */
    x = (vf)(((vi)x & ~under) | ((vi)lo & under));
    const vf n = (x * 1.44269504088896341f + shifter) - shifter; /* round to nearest, exactly */
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf e = p * r * r + r + 1.f;
    const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    const vf inf = (vf){0} + __builtin_inff();
    return (vf)(((vi)(e * (vf)two_n) & ~over) | ((vi)inf & over));
}

static inline float exp_s(float x) {
    vf v = (vf){0} + x;
    return exp_v(v)[0];
}

/* SwiGLU's activation: gate_up [T, ld] holds gate then up (n columns each);
 * out [T, n] = (gate / (1 + e^-gate)) * up, the operator order of torch's
 * F.silu(gate) * up. One pass, no temporaries; threads only for large T x n,
 * where a decode batch's few rows would cost more in waking a thread. */
void silu_mul(const float *gate_up, int64_t ld, float *out, int64_t T, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T * n >= (1 << 17))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * ld, *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
            const vf x = *(const vfu *)(g + i);
            *(vfu *)(o + i) = (x / (1.f + exp_v(-x))) * *(const vfu *)(u + i);
        }
        for (; i < n; i++) o[i] = (g[i] / (1.f + exp_s(-g[i]))) * u[i];
    }
}

/* GeGLU's activation with gelu_pytorch_tanh (Gemma): gate_up [T, ld] holds gate then up
 * (n columns each); out [T, n] = gelu_tanh(gate) * up, where
 * gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3). Since
 * 1 + tanh(y) = 2 / (1 + e^-2y), that is x / (1 + e^-2y): SiLU's form, without the
 * cancellation of 1 + tanh(y) where tanh(y) is near -1 (torch's float32 tanh there loses
 * every digit of a small negative output). Both the native decoder stack and the Python
 * layers call this kernel, so their outputs agree bit for bit. */
#define GELU_2C 1.5957691216057308f /* 2 sqrt(2 / pi) */
void gelu_tanh_mul(const float *gate_up, int64_t ld, float *out, int64_t T, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T * n >= (1 << 17))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * ld, *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
            const vf x = *(const vfu *)(g + i);
            const vf z = x + 0.044715f * (x * x * x);
            *(vfu *)(o + i) = (x / (1.f + exp_v(-GELU_2C * z))) * *(const vfu *)(u + i);
        }
        for (; i < n; i++) {
            const float x = g[i], z = x + 0.044715f * (x * x * x);
            o[i] = (x / (1.f + exp_s(-GELU_2C * z))) * u[i];
        }
    }
}

/* Greedy sampling: the index of each row's largest value, the first one on ties
 * (torch.argmax's answer). One vector pass with four running (max, index)
 * pairs per lane, so that four compares are in flight instead of one chain; a
 * lane keeps the first index of its maximum (strict >), and the lanes are
 * merged by value, then by the smaller index. A row with a NaN gets -1: the
 * caller asks torch for it, whose answer is the NaN's index. Rows are split
 * among the threads (each row is independent: the same answer at any count).
 * Returns the number of rows with a NaN. */
#define AM_ACC 4
static int64_t argmax_row(const float *p, int64_t n) {
    int64_t i = 0, index = 0;
    float best = -__builtin_inff();
    int bad = 0;
    if (n >= AM_ACC * VL && n <= INT32_MAX) {
        vf m[AM_ACC];
        vi idx[AM_ACC], nan = {0};
        for (int a = 0; a < AM_ACC; a++) {
            m[a] = (vf){0} - __builtin_inff();
            for (int j = 0; j < VL; j++) idx[a][j] = a * VL + j; /* -inf lanes keep their first index */
        }
        vi cur = {0};
        for (int j = 0; j < VL; j++) cur[j] = j;
        for (; i + AM_ACC * VL <= n; i += AM_ACC * VL) {
            for (int a = 0; a < AM_ACC; a++) {
                const vf v = *(const vfu *)(p + i + a * VL);
                const vi gt = v > m[a]; /* lanes of all ones where v is larger: a branch-free select */
                m[a] = (vf)(((vi)v & gt) | ((vi)m[a] & ~gt));
                idx[a] = (cur & gt) | (idx[a] & ~gt);
                nan |= v != v;
                cur += VL;
            }
        }
        best = m[0][0], index = idx[0][0];
        for (int a = 0; a < AM_ACC; a++)
            for (int j = 0; j < VL; j++) {
                bad |= nan[j];
                const float x = m[a][j];
                if (x > best || (x == best && idx[a][j] < index)) best = x, index = idx[a][j];
            }
    } else if (n > 0) {
        best = p[0];
        bad = p[0] != p[0];
        i = 1;
    }
    for (; i < n; i++) {
        bad |= p[i] != p[i];
        if (p[i] > best) best = p[i], index = i;
    }
    return bad ? -1 : index;
}

int64_t argmax_rows(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad) \
    if (num_threads > 1 && rows > 1 && rows * n >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        out[r] = argmax_row(x + r * ld, n);
        bad += out[r] < 0;
    }
    return bad;
}

/* rope_split for partial rotary (Phi-3): only the first R dims of each q and k head rotate,
 * pairs (x[i], x[i + R/2]) with cos, sin [T, R/2]; dims R..D of each head are copied as they are. */
void rope_split_partial(const float *qkv, int64_t ld, const float *cos, const float *sin, float *q, float *k,
                        float *v, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R, int num_threads) {
    const int64_t half = R / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ld, *c = cos + t * half, *s = sin + t * half;
        for (int64_t head = 0; head < H + KVH; head++) {
            const float *x = row + head * D;
            float *o = head < H ? q + (t * H + head) * D : k + (t * KVH + head - H) * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
            memcpy(o + R, x + R, sizeof(float) * (size_t)(D - R));
        }
        memcpy(v + t * KVH * D, row + (H + KVH) * D, sizeof(float) * (size_t)(KVH * D));
    }
}
