/* Float32 y = x @ W^T (+ bias) over quantized weights, for the CPU linear layers
 * of quantized checkpoints (issue 39). Three kernels, read gemm_f32.c first (the
 * blocking is its: W packed once at load into panels of NR output features,
 * k-major, so an MR x NR tile of accumulators stays in registers for the whole
 * K loop; near-equal row tiles; threads split whole panels, or rows, never K,
 * so no output depends on the thread count or on the batch's other rows).
 *
 * 1. W8A8 (gemm_w8a8): int8 weights with one float32 scale per output row,
 *    activations quantized inside the call, per row, symmetric:
 *        s = max|x| / 127 (1 where that is 0), q = rint(x / s) clamped to +-127,
 *    bit for bit worker/gemm_quant_kernels.py's quantize_rows (x / s is one
 *    correctly rounded division, rint rounds half to even in the default
 *    rounding mode; a row holding a NaN or an infinity gets s = NaN and q = 0,
 *    so its outputs are NaN). Then
 *        y[m, n] = (float)acc * sx[m] * sw[n] + bias[n],  acc = sum_k q[m, k] * w[n, k]
 *    with acc an exact int32: |acc| <= 127 * 128 * K < 2^31 for K <= 132104
 *    (the Python side refuses more). The product's ISA is the compiler's:
 *      - AVX512_VNNI: vpdpbusd on 512-bit vectors, u8 x s8 in groups of 4 k
 *        per int32 lane. x is shifted to unsigned (q + 128, 1..255) and the
 *        sum of 128 * w[n, k] over k (precomputed at pack time, `corr`) is
 *        taken off at the end; int32 arithmetic wraps modulo 2^32, so the
 *        difference is exact whenever the true sum fits, as above.
 *      - AVX_VNNI (or AVX512_VNNI built with -DQUANT_VNNI_256, which the tests
 *        use to run this path on an AVX-512 host): the same on 256-bit vectors.
 *      - AVX2: vpmaddubsw multiplies u8 by s8 into int16 pair sums, then
 *        vpmaddwd by ones widens pairs into int32. The u8 operand is |w|
 *        (0..128: |-128| is 0x80, 128 as unsigned) and the signed one is x
 *        with w's sign moved onto it (vpsignb; x is in -127..127, so negating
 *        it cannot overflow). Worst int16 pair: 128 * 127 * 2 = 32512 <=
 *        32767, so the saturating vpmaddubsw never saturates.
 *      - portable C (any CPU): the same sums in int32.
 *    Panels: [ceil(N / NR8), ceil(K / 4), NR8, 4] int8, k in groups of 4 per
 *    feature (vpdpbusd's lane), K padded with zero weights (and zero x), the
 *    tail panel with zero features. A 512-bit tile is 6 rows x 4 vectors (24
 *    of the 32 registers hold sums); 256-bit ones are 6 x 2 (VNNI) or 4 x 2
 *    (AVX2, which needs temporaries), within 16 registers.
 *
 * 2. Weight-only W4A16 / W8A16 (gemm_wq): integer weights q (4 or 8 bits), a
 *    float32 scale and optionally an integer zero point per group of `group`
 *    consecutive k of a row; x stays float32. The order of the sums:
 *        part_g = sum over k of group g, in order, of x[k] * (q[k] - zero_g)
 *                 (float32, one fused multiply-add per k where the CPU has FMA)
 *        total  = part_g * scale_g + total, fused, over g in order; y = total + bias
 *    q - zero is an integer, exact in float32, and so is every product's input:
 *    the only roundings are the sums'. Stored unsigned, u = q + 8 (4 bits) or
 *    q + 128 (8 bits), zero points the same (zz = zero + offset), q - zero is
 *    made in registers exactly as (2^23 + u) - (2^23 + zz): 2^23 + u is u's
 *    bits or-ed into 2^23's (float32 holds every integer below 2^24) and the
 *    difference of two such floats is exact; on AVX-512 a symmetric 4-bit value
 *    instead indexes a table of the 16 values (vpermps reads the low 4 bits of
 *    each lane, so the nibble needs no mask). At one or two rows the decoding is
 *    the work (the weight bytes are an eighth of float32's, the arithmetic is
 *    not): a row takes four panels at a time (eight independent sums hide the
 *    FMA latency), two rows two. From WQ_WIDEN_TILES row tiles on, a panel's
 *    q - zero is decoded once into thread-local float32 scratch and the tiles
 *    read that: the same numbers, the same order, so the same bits whichever
 *    path, thread count or batch. Panels: NR = 2 vector widths of features
 *    (the float32 GEMM's), [P, K, NR / 2] bytes at 4 bits (byte j: feature j
 *    in the low nibble, feature VL + j in the high one, so a k-row is one
 *    VL-byte load), [P, K, NR] at 8 bits; scales [P, K / group, NR] float32,
 *    zero points [P, K / group, NR] bytes. The vector code is GCC's vector
 *    extensions: AVX-512, AVX2 or SSE2 as -march says.
 *
 * 3. W4A8 (gemm_w4a8): 4-bit weights with group scales and zero points (or
 *    float group minimums, GGUF Q4_K), activations quantized to int8 with a
 *    scale per row and group of the weight's (W8A8's rule over each group
 *    alone, as llama.cpp's Q8_0 / Q8_K blocks: one outlier feature coarsens
 *    only its own group); per group an exact int32 sum, then float32 fused
 *    multiply-adds (its part below has the order).
 *
 * 4. W8A8g (gemm_w8a8g): 8-bit weights (-128..127: GGUF Q8_0, Q6_K, the merged
 *    Q4_K / Q6_K layers, W8A16) with a float32 scale per group (and zero
 *    points, or float minimums), on W4A8's activations (int8 per row and
 *    group of the weight's): the same per-group int32 sums and the same fmaf
 *    order as W4A8 (the same code, the weights 8-bit: the W4A8 part has it).
 *
 * 5. Descriptor entries (gemm_w8a8_desc, gemm_wq_desc, gemm_w4a8_desc,
 *    gemm_w8a8g_desc, gemm_fp8_desc): the native decoder driver's gemm_fn
 *    signature, `packed` a GemmQuantDesc (the last part of this file). The
 *    fp8 kind's kernel is worker/csrc/gemm_fp8.c, reached through the
 *    descriptor (its comment there says why).
 *
 * No -ffast-math: the sums above are the documented ones.
 *
 * x:  [M, K] float32, row stride ldx;  y: [M, N] float32, row stride ldy;
 * bias: [N] float32 or NULL.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the packed layouts assume a little-endian CPU"
#endif

/* ---------------------------------------------------------------- shared */

#define SCRATCH_OWNER "gemm_quant"
#include "thread_scratch.h"
#include "group_out.h"
#include "w8a8_out.h"

/* The calling thread's share [*lo, *hi) of n items, inside a parallel region (all of them outside). */
static inline void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t tid = 0, nth = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    nth = omp_get_num_threads();
#endif
    *lo = n * tid / nth, *hi = n * (tid + 1) / nth;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------- W8A8 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(QUANT_VNNI_256)
#define I8_PATH 3 /* avx512_vnni */
#elif defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define I8_PATH 2 /* avx_vnni (256-bit) */
#elif defined(__AVX2__)
#define I8_PATH 1 /* avx2 */
#else
#define I8_PATH 0 /* portable */
#endif

#if I8_PATH == 3
#define I8_L 16 /* int32 lanes per vector */
#define I8_NV 4 /* vectors per panel */
#define I8_MR 6
typedef __m512i ivec;
typedef __m512i wprep;
static inline __attribute__((always_inline)) wprep i8_prep(const int8_t *p) { return _mm512_loadu_si512(p); }
static inline __attribute__((always_inline)) ivec i8_bcast(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline __attribute__((always_inline)) ivec i8_dot(ivec acc, ivec a, wprep w) {
    return _mm512_dpbusd_epi32(acc, a, w);
}
#elif I8_PATH == 2 || I8_PATH == 1
#define I8_L 8
#define I8_NV 2
typedef __m256i ivec;
static inline __attribute__((always_inline)) ivec i8_bcast(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#if I8_PATH == 2
#define I8_MR 6
typedef __m256i wprep;
static inline __attribute__((always_inline)) wprep i8_prep(const int8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline __attribute__((always_inline)) ivec i8_dot(ivec acc, ivec a, wprep w) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, a, w);
#else
    return _mm256_dpbusd_epi32(acc, a, w);
#endif
}
#else
#define I8_MR 4
typedef struct {
    __m256i w, aw; /* the weights and their magnitudes (as unsigned bytes) */
} wprep;
static inline __attribute__((always_inline)) wprep i8_prep(const int8_t *p) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    return (wprep){w, _mm256_abs_epi8(w)};
}
static inline __attribute__((always_inline)) ivec i8_dot(ivec acc, ivec a, wprep w) {
    /* |w| (u8) times x with w's sign (s8): pairs into int16 (no saturation, see the top), pairs of those into int32 */
    const __m256i pairs = _mm256_maddubs_epi16(w.aw, _mm256_sign_epi8(a, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
#else
#define I8_L 8
#define I8_NV 2
#define I8_MR 4
#endif

#define I8_NR (I8_L * I8_NV)
#define I8_SHIFT (I8_PATH >= 2) /* x stored as q + 128 (unsigned) for vpdpbusd */
#define I8_MB 256              /* rows per block: a block's quantized rows stay in L2 while the panels pass */

int gemm_quant_isa(void) { return I8_PATH; }
int64_t gemm_quant_i8_nr(void) { return I8_NR; }
int gemm_quant_i8_shift(void) { return I8_SHIFT; }

/* One row of x quantized into q (K4 * 4 bytes, the padding 0), its scale into *s; returns the sum of q.
 * shift: store q + 128 as unsigned bytes. */
static inline __attribute__((always_inline)) int32_t quant_row(const float *restrict x, int64_t K, int64_t Kp,
                                                               uint8_t *restrict q, float *s, const int shift) {
    /* max |x| by its bits: non-negative floats order as their bits do, and the infinities and NaNs lie
     * above FLT_MAX's (an integer max vectorizes; the float one, NaN-aware, stays scalar and serial). */
    uint32_t umax = 0;
    for (int64_t k = 0; k < K; k++) {
        uint32_t u;
        memcpy(&u, x + k, 4);
        u &= 0x7fffffffu;
        umax = u > umax ? u : umax;
    }
    const int bad = umax > 0x7f7fffffu; /* NaN or infinity */
    float amax;
    memcpy(&amax, &umax, 4);
    const uint8_t zero = shift ? 128 : 0;
    if (bad) {
        *s = NAN;
        memset(q, zero, (size_t)Kp);
        return 0;
    }
    float sc = amax / 127.0f;
    if (sc == 0.0f) sc = 1.0f; /* a row of zeros (or so small that max / 127 underflows): q = rint(x) = 0 */
    *s = sc;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = rintf(x[k] / sc);
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        sum += (int)v;
        q[k] = (uint8_t)((int)v + zero);
    }
    for (int64_t k = K; k < Kp; k++) q[k] = zero;
    return sum;
}

/* quantize_rows in C, for the tests: q [M, K] int8 (row stride ldq), s [M]. */
void quant_rows_i8(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *q, int64_t ldq, float *s) {
    for (int64_t m = 0; m < M; m++) quant_row(x + m * ldx, K, K, (uint8_t *)(q + m * ldq), s + m, 0);
}

typedef float q4f __attribute__((vector_size(16 * sizeof(float)), aligned(sizeof(float)))); /* I8_NR's unit */

/* A tile's row of ncols outputs into y: a whole panel's a vector at a time (a memcpy of a runtime
 * size is a libc call per row and tile). */
static inline __attribute__((always_inline)) void q4_store(float *y, const float *row, int64_t ncols) {
    if (ncols == I8_NR)
        for (int j = 0; j < I8_NR; j += 16) *(q4f *)(y + j) = *(const q4f *)(row + j);
    else
        memcpy(y, row, sizeof(float) * (size_t)ncols);
}

/* One mr x I8_NR tile: quantized rows xq (row stride ldq bytes) against one panel. */
static inline __attribute__((always_inline)) void i8_tile(
    const uint8_t *xq, int64_t ldq, const int8_t *panel, int64_t K4, const int32_t *corr, const float *sx,
    const float *sw, const float *bias, float *y, int64_t ldy, int64_t ncols, const int mr) {
    int32_t sums[I8_MR][I8_NR];
#if I8_PATH == 0
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < I8_NR; j++) sums[r][j] = 0;
    for (int64_t k4 = 0; k4 < K4; k4++) {
        const int8_t *w = panel + k4 * I8_NR * 4;
        for (int r = 0; r < mr; r++) {
            const int8_t *a = (const int8_t *)xq + r * ldq + 4 * k4;
            const int32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
            for (int j = 0; j < I8_NR; j++)
                sums[r][j] += a0 * w[4 * j] + a1 * w[4 * j + 1] + a2 * w[4 * j + 2] + a3 * w[4 * j + 3];
        }
    }
#else
    ivec acc[I8_MR][I8_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < I8_NV; v++) acc[r][v] = (ivec){0};
    for (int64_t k4 = 0; k4 < K4; k4++) {
        wprep w[I8_NV];
        for (int v = 0; v < I8_NV; v++) w[v] = i8_prep(panel + (k4 * I8_NR + v * I8_L) * 4);
        for (int r = 0; r < mr; r++) {
            const ivec a = i8_bcast(xq + r * ldq + 4 * k4);
            for (int v = 0; v < I8_NV; v++) acc[r][v] = i8_dot(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < I8_NV; v++) memcpy(sums[r] + v * I8_L, &acc[r][v], sizeof(ivec));
#endif
    for (int r = 0; r < mr; r++) {
        float out[I8_NR];
        w8a8_out(sums[r], corr, sx[r], sw, bias, out, I8_NR);
        q4_store(y + r * ldy, out, ncols);
    }
}

/* Rows [0, M) against panels [p0, p1), in blocks of I8_MB rows, each block's row tiles of near-equal height. */
static void i8_range(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *packed, const int32_t *corr,
                     const float *sw, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K4,
                     int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
        const int64_t rows = min64(M - m0, I8_MB);
        const int64_t tiles = (rows + I8_MR - 1) / I8_MR, base = rows / tiles, taller = rows % tiles;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * I8_NR, ncols = min64(N - n0, I8_NR);
            const int8_t *panel = packed + p * K4 * I8_NR * 4;
            const float *b = bias == NULL ? NULL : bias + n0;
            for (int64_t t = 0, m = m0; t < tiles; m += base + (t < taller), t++) {
                const int64_t h = base + (t < taller);
                const uint8_t *xm = xq + m * ldq;
                float *ym = y + m * ldy + n0;
#define I8_TILE(H) i8_tile(xm, ldq, panel, K4, corr + n0, sx + m, sw + n0, b, ym, ldy, ncols, H)
                switch (h) {
#if I8_MR > 4
                    case 6: I8_TILE(6); break;
                    case 5: I8_TILE(5); break;
#endif
                    case 4: I8_TILE(4); break;
                    case 3: I8_TILE(3); break;
                    case 2: I8_TILE(2); break;
                    default: I8_TILE(1); break;
                }
#undef I8_TILE
            }
        }
    }
}

static _Thread_local Scratch quantized;

/* The W8A8 product on AMX-INT8 tiles: gemm_amx.c's gemm_amx_w8a8_range (its comment has the
 * contract), given here by worker/gemm_quant_kernels.py where the tiles are usable and agree with
 * vpdpbusd, for calls of at least w8a8_tiles_rows rows; NULL: vpdpbusd. The same exact int32 sums
 * and the same w8a8_out, so the same bits either way. Only the 512-bit VNNI build's panels (64
 * features, unsigned x) are the tiles' layout. */
typedef void (*w8a8_tiles_fn)(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *packed,
                              const int32_t *corr, const float *sw, const float *bias, float *y, int64_t ldy,
                              int64_t M, int64_t N, int64_t K4, int64_t nr, int64_t p0, int64_t p1);
static w8a8_tiles_fn w8a8_tiles;
static int64_t w8a8_tiles_rows;
#define TILE_K 64 /* k of one A tile row: the tiles' quantized rows are padded to a multiple */
#define TILE_ROWS 16

/* Returns 0, or -1 where this build's W8A8 panels are not the tiles' layout (fn stays NULL). */
int gemm_quant_set_w8a8_tiles(w8a8_tiles_fn fn, int64_t min_rows) {
    if (fn != NULL && !(I8_PATH == 3 && I8_NR == 64 && I8_SHIFT)) return -1;
    w8a8_tiles = fn, w8a8_tiles_rows = min_rows;
    return 0;
}

/* packed: [ceil(N / I8_NR), ceil(K / 4), I8_NR, 4] int8; corr: [panels * I8_NR] int32, 128 * the sum of each
 * feature's weights where I8_SHIFT (else zeros); sw: [panels * I8_NR] float32 (the padding anything finite). */
void gemm_w8a8(const float *x, int64_t ldx, const int8_t *packed, const int32_t *corr, const float *sw,
               const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    const w8a8_tiles_fn tiles = M >= w8a8_tiles_rows ? w8a8_tiles : NULL;
    const int64_t K4 = (K + 3) / 4, panels = (N + I8_NR - 1) / I8_NR;
    /* The tiles read whole A tiles: rows padded to TILE_K bytes, and TILE_ROWS rows more (zeros)
     * past the last, which a row split's last tile may read. */
    const int64_t ldq = tiles ? (K4 * 4 + TILE_K - 1) / TILE_K * TILE_K : K4 * 4;
    const int64_t rows = tiles ? M + TILE_ROWS : M;
    const size_t qbytes = (size_t)(rows * ldq + 63) / 64 * 64;
    uint8_t *xq = scratch_for(&quantized, qbytes + sizeof(float) * (size_t)M, "quantized activations");
    float *sx = (float *)(xq + qbytes);
    if (tiles) memset(xq + M * ldq, 0, (size_t)(TILE_ROWS * ldq));
    /* Threads over whole panels; over rows where there are fewer panels than threads. */
    const int64_t units = panels >= num_threads ? panels : (M > panels ? M : panels);
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t lo, hi;
        thread_share(M, &lo, &hi);
        for (int64_t m = lo; m < hi; m++) quant_row(x + m * ldx, K, ldq, xq + m * ldq, sx + m, I8_SHIFT);
#pragma omp barrier
        int nth = 1;
#ifdef _OPENMP
        nth = omp_get_num_threads();
#endif
        if (panels >= nth) {
            thread_share(panels, &lo, &hi);
            if (tiles)
                tiles(xq, ldq, sx, packed, corr, sw, bias, y, ldy, M, N, K4, I8_NR, lo, hi);
            else
                i8_range(xq, ldq, sx, packed, corr, sw, bias, y, ldy, M, N, K4, lo, hi);
        } else {
            thread_share(M, &lo, &hi);
            if (tiles && hi > lo)
                tiles(xq + lo * ldq, ldq, sx + lo, packed, corr, sw, bias, y + lo * ldy, ldy, hi - lo, N, K4, I8_NR,
                      0, panels);
            else if (!tiles)
                i8_range(xq + lo * ldq, ldq, sx + lo, packed, corr, sw, bias, y + lo * ldy, ldy, hi - lo, N, K4, 0,
                         panels);
        }
    }
}

/* ---------------------------------------------------------------- W4A8 and W8A8g */

/* 4-bit weights (u = q + offset in 0..15: offset 8 for signed q in -8..7, 0 for unsigned q with a float
 * minimum), a float32 scale per group of `group` k, and either an integer zero point (zu = zero + offset)
 * or a float minimum per group, or neither. The activations are quantized per row and group of the
 * weight's (quant_groups: quant_row's rule over the group's k alone, not shifted: q in -127..127),
 *     sx[m, g] = max_g |x| / 127 (1 where that is 0; NaN, with the group's q 0, where it holds a NaN or
 *                an infinity),  qx = rint(x / sx[m, g]) clamped to +-127,
 * bit for bit worker/gemm_quant_kernels.py's quantize_groups; with them, per row and group, the sum
 * xsum[m, g] = sum_g qx and cx[m, g] = -(float)xsum[m, g] * sx[m, g] (one rounding; the minimums' factor).
 * Per group g:
 *     acc  = sum_k qx[m, k] * u[n, k]                  (int32, exact: vpdpbusd with u the unsigned operand)
 *     i_g  = acc - zu[n, g] * xsum[m, g]               (int32, exact; zu = offset without zero points)
 *          = sum_k qx * (q - zero)
 *     tot  = fmaf((float)i_g * sx[m, g], scale[n, g], tot)   (over g in order, from 0; the product rounded)
 *     tot  = fmaf(cx[m, g], minimum[n, g], tot)              (only with minimums: w = u * scale - minimum)
 * then y = tot + bias[n] (or tot without a bias). The activation side is scaled first, as the minimum term's
 * factor is (once per row and group there, since it does not depend on n): one multiply more per output
 * and group than one scale per row took (measured on Zen 4, 2 threads, group 128: up to +4% at 32 and 128
 * rows of K = 768, and the per-group quantization's overhead; both more than paid back at K = 2048 by
 * quant_row's vectorized max, which made the quantization 3x faster, so overall -10% to +4%). A group of
 * zeros gives i_g = 0 and adds nothing; a non-finite one makes every output of its row NaN. |i_g| <= 15 *
 * 127 * group, so the int32s are exact for any group below 2^20 and (float)i_g exact below group 8808.
 * fmaf is one rounding on every build (the vectorizer's vfmadd with FMA, libm's fmaf without; no product
 * here can be contracted into an addition), so every ISA gives the same bits, whatever the thread count
 * or the batch's other rows. On AVX2, vpmaddubsw (u8 weights x s8 x:
 * pairs at most 2 * 15 * 127 = 3810, never saturating) then vpmaddwd by ones.
 * Panels: [ceil(N / NR8), K / 4, NV / 2, L * 4] bytes (NR8 = I8_NR features in NV vectors of L int32
 * lanes, 4 k per lane as W8A8's): byte b of chunk j holds vector j's byte b in its low nibble and vector
 * j + NV / 2's in the high one, so a k4 step of a panel is NV / 2 vector loads, K / 2 bytes per feature.
 * scales, minimums: [.., K / group, NR8] float32; zero points: [.., K / group, NR8] bytes. Every tile
 * unpacks the nibbles in registers (two ands and a shift per two weight vectors): unpacking a panel once
 * into scratch for many row tiles, as the weight-only kernel does, measured slower on Zen 4 (the
 * scratch's writes and reads cost more than the in-register unpacking they save).
 *
 * W8A8g (gemm_w8a8g) is the same code with 8-bit weights (b8 below): q in -128..127 stored as
 * u = q + 128 (0..255, one byte: vpdpbusd's unsigned operand, as the nibbles are W4A8's), zero points as
 * zu = zero + 128 in bytes, offset 128 with minimums too (w = q * scale - minimum = (u - 128) * scale -
 * minimum, q signed). The same activations, the same i_g = acc - zu * xsum = sum_k qx * (q - zero), the
 * same fmaf order as above, so the same bits on every build, thread count and batch. |acc| and |i_g| are
 * at most 255 * 127 * group: exact int32s for group <= 66311 (the Python side refuses more); (float)i_g
 * is exact below group 518 and one rounding above (per channel at a large K), the same on every build.
 * On AVX2 the unsigned bytes cannot go through vpmaddubsw (2 * 255 * 127 overflows its int16 pairs), so
 * u ^ 0x80 = q takes W8A8's path there (|q| the unsigned operand, x with q's sign: pairs at most
 * 2 * 128 * 127 = 32512); that sum is sum qx * q = acc - 128 * xsum, so the correction takes zu - 128
 * (W8G_ADJ): the same i_g. Panels: W8A8's layout, [ceil(N / NR8), K / 4, NR8, 4] bytes (4 k of a feature
 * per int32 lane; K / 4 whole, the group being a multiple of 4 dividing K), loaded as they are; scales,
 * minimums and zero points as W4A8's. No per-feature column sums (W8A8's `corr`): x is the signed operand,
 * so the +128 of the weights is taken off as 128 * xsum per row and group, computed with the
 * activations, where a table of column sums per group and feature would add a quarter byte per weight
 * at group 16 (Q6_K) to what a decoding step reads. */

int64_t gemm_quant_i8_lanes(void) { return I8_L; }

#define W8G_ADJ (I8_PATH == 1 ? 128 : 0) /* what the AVX2 sums of 8-bit weights lack of the stored offset */

#if I8_PATH >= 1
static inline __attribute__((always_inline)) ivec q4_dot(ivec acc, ivec w, ivec x) {
#if I8_PATH == 3
    return _mm512_dpbusd_epi32(acc, w, x);
#elif I8_PATH == 2 && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif I8_PATH == 2
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* The NV weight vectors (unsigned bytes 0..15) of one k4 step, from its NV / 2 vectors of nibbles. */
static inline __attribute__((always_inline)) void q4_weights(const uint8_t *p, ivec w[I8_NV]) {
#if I8_PATH == 3
    const __m512i low = _mm512_set1_epi8(15);
    for (int j = 0; j < I8_NV / 2; j++) {
        const __m512i b = _mm512_loadu_si512(p + j * I8_L * 4);
        w[j] = _mm512_and_si512(b, low);
        w[j + I8_NV / 2] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
#else
    const __m256i low = _mm256_set1_epi8(15);
    for (int j = 0; j < I8_NV / 2; j++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(p + j * I8_L * 4));
        w[j] = _mm256_and_si256(b, low);
        w[j + I8_NV / 2] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
#endif
}
#endif

/* One k4 step's unsigned weight of feature f (0..I8_NR), k 4 * k4 + i, from a panel's nibbles or bytes. */
static inline uint8_t q4_at(const int b8, const uint8_t *panel, int64_t k4, int f, int i) {
    if (b8) return panel[(k4 * I8_NR + f) * 4 + i];
    const int v = f / I8_L, b = (f % I8_L) * 4 + i;
    const uint8_t byte = panel[k4 * (I8_NR * 2) + (v % (I8_NV / 2)) * I8_L * 4 + b];
    return v < I8_NV / 2 ? byte & 15 : byte >> 4;
}

/* Quantized activations of W4A8, per row and group (row strides ldq bytes and G groups). */
typedef struct {
    const int8_t *q;
    const float *s, *c; /* sx[m, g]; cx[m, g] = -(float)xsum * sx */
    const int32_t *sum; /* xsum[m, g] */
    int64_t ldq, G;
} Q4X;

static inline Q4X q4x_rows(Q4X X, int64_t m) {
    X.q += m * X.ldq, X.s += m * X.G, X.c += m * X.G, X.sum += m * X.G;
    return X;
}

/* x's row quantized in groups of `group` (K a multiple): quant_row over each group's k, into q (signed),
 * s[g], with sum[g] = the group's sum of q and c[g] = -(float)sum[g] * s[g]. */
static void quant_groups(const float *x, int64_t K, int64_t group, int8_t *q, float *s, float *c, int32_t *sum) {
    for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += group) {
        const int32_t t = quant_row(x + k0, group, group, (uint8_t *)q + k0, s + g, 0);
        sum[g] = t;
        c[g] = -(float)t * s[g];
    }
}

/* quantize_groups in C, for the tests: q [M, K] int8 (row stride ldq), s [M, K / group]. */
void quant_groups_i8(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t group, int8_t *q, int64_t ldq,
                     float *s) {
    const int64_t G = K / group;
    float *c = malloc(sizeof(float) * (size_t)(G ? G : 1));
    int32_t *sum = malloc(sizeof(int32_t) * (size_t)(G ? G : 1));
    if (c == NULL || sum == NULL) abort();
    for (int64_t m = 0; m < M; m++) quant_groups(x + m * ldx, K, group, q + m * ldq, s + m * G, c, sum);
    free(c);
    free(sum);
}

/* A group's int32 sums of an mr x I8_NR tile into the float totals (the order at the top of this part);
 * X at the tile's first row and this group. adj: what the sums lack of the stored offset (W8G_ADJ). */
static inline __attribute__((always_inline)) void q4_group(
    int32_t sums[I8_MR][I8_NR], float *restrict tot, int64_t ld, const Q4X *X, int64_t g, const float *scale,
    const uint8_t *zeros, const float *mins, int32_t off, const int adj, const int mr, const int zp, const int mn) {
    for (int r = 0; r < mr; r++, tot += ld)
        group_out(sums[r], tot, X->sum[r * X->G + g], X->s[r * X->G + g], X->c[r * X->G + g], scale, zeros, mins,
                  off, adj, zp, mn, I8_NR);
}


/* One mr x I8_NR tile of the quantized rows X against a panel (4-bit, or 8-bit where b8). */
static inline __attribute__((always_inline)) void q4_tile(
    const Q4X *X, const uint8_t *panel, int64_t K4, int64_t gk4, const float *scales, const uint8_t *zeros,
    const float *mins, int32_t off, const float *bias, float *y, int64_t ldy, int64_t ncols, const int mr,
    const int zp, const int mn, const int b8) {
    const int8_t *xq = X->q;
    const int64_t ldq = X->ldq;
    /* The float totals: zeroed and written out a vector at a time (as loops, GCC made them libc
     * calls per tile and row: 7 % of a W4A8 prefill). */
    float tot[I8_MR * I8_NR];
    const int64_t ld = I8_NR;
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < I8_NR; j += 16) *(q4f *)(tot + r * ld + j) = (q4f){0};
    int32_t sums[I8_MR][I8_NR];
    for (int64_t g = 0, k4 = 0; k4 < K4; g++) {
        const int64_t end = k4 + gk4;
#if I8_PATH == 0
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < I8_NR; j++) sums[r][j] = 0;
        for (; k4 < end; k4++)
            for (int j = 0; j < I8_NR; j++) {
                int32_t u[4];
                for (int i = 0; i < 4; i++) u[i] = q4_at(b8, panel, k4, j, i);
                for (int r = 0; r < mr; r++) {
                    const int8_t *a = xq + r * ldq + 4 * k4;
                    sums[r][j] += a[0] * u[0] + a[1] * u[1] + a[2] * u[2] + a[3] * u[3];
                }
            }
#else
        ivec acc[I8_MR][I8_NV];
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < I8_NV; v++) acc[r][v] = (ivec){0};
        for (; k4 < end; k4++) {
            if (b8) {
                /* u as loaded (vpdpbusd); on AVX2 q = u ^ 0x80 and its magnitudes, W8A8's product. */
                wprep w[I8_NV];
                for (int v = 0; v < I8_NV; v++) {
#if I8_PATH == 1
                    const __m256i q = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(panel + (k4 * I8_NR + v * I8_L) * 4)),
                        _mm256_set1_epi8((char)0x80));
                    w[v] = (wprep){q, _mm256_abs_epi8(q)};
#else
                    w[v] = i8_prep((const int8_t *)panel + (k4 * I8_NR + v * I8_L) * 4);
#endif
                }
                for (int r = 0; r < mr; r++) {
                    const ivec a = i8_bcast((const uint8_t *)xq + r * ldq + 4 * k4);
#if I8_PATH == 1
                    for (int v = 0; v < I8_NV; v++) acc[r][v] = i8_dot(acc[r][v], a, w[v]);
#else
                    for (int v = 0; v < I8_NV; v++) acc[r][v] = q4_dot(acc[r][v], w[v], a);
#endif
                }
            } else {
                ivec w[I8_NV];
                q4_weights(panel + k4 * I8_NR * 2, w);
                for (int r = 0; r < mr; r++) {
                    const ivec a = i8_bcast((const uint8_t *)xq + r * ldq + 4 * k4);
                    for (int v = 0; v < I8_NV; v++) acc[r][v] = q4_dot(acc[r][v], w[v], a);
                }
            }
        }
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < I8_NV; v++) memcpy(sums[r] + v * I8_L, &acc[r][v], sizeof(ivec));
#endif
        q4_group(sums, tot, ld, X, g, scales + g * I8_NR, zp ? zeros + g * I8_NR : NULL,
                 mn ? mins + g * I8_NR : NULL, off, b8 ? W8G_ADJ : 0, mr, zp, mn);
    }
    if (bias != NULL)
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < I8_NR; j++) tot[r * ld + j] += bias[j];
    for (int r = 0; r < mr; r++) q4_store(y + r * ldy, tot + r * ld, ncols);
}

typedef struct {
    const uint8_t *packed, *zeros;
    const float *scales, *mins, *bias;
    int64_t N, K4, gk4, G;
    int32_t off;
    int b8; /* 8-bit weights (W8A8g), else 4-bit */
} Q4Args;

/* Rows [0, M) against panels [p0, p1), in blocks of I8_MB rows, each block's row tiles of near-equal height. */
static inline __attribute__((always_inline)) void q4_range_(const Q4Args *A, const Q4X *X, float *y, int64_t ldy,
                                                            int64_t M, int64_t p0, int64_t p1, const int zp,
                                                            const int mn, const int b8) {
    const int64_t K4 = A->K4, G = A->G, gsize = G * I8_NR;
    const int32_t off = b8 ? 128 : A->off;
    for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
        const int64_t rows = min64(M - m0, I8_MB);
        const int64_t tiles = (rows + I8_MR - 1) / I8_MR, base = rows / tiles, taller = rows % tiles;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * I8_NR, ncols = min64(A->N - n0, I8_NR);
            const uint8_t *panel = A->packed + p * K4 * I8_NR * (b8 ? 4 : 2);
            const float *b = A->bias == NULL ? NULL : A->bias + n0;
            const float *sc = A->scales + p * gsize, *mi = mn ? A->mins + p * gsize : NULL;
            const uint8_t *ze = zp ? A->zeros + p * gsize : NULL;
            for (int64_t t = 0, m = m0; t < tiles; m += base + (t < taller), t++) {
                const int64_t h = base + (t < taller);
                const Q4X xm = q4x_rows(*X, m);
                float *ym = y + m * ldy + n0;
#define Q4_TILE(H) q4_tile(&xm, panel, K4, A->gk4, sc, ze, mi, off, b, ym, ldy, ncols, H, zp, mn, b8)
                switch (h) {
#if I8_MR > 4
                    case 6: Q4_TILE(6); break;
                    case 5: Q4_TILE(5); break;
#endif
                    case 4: Q4_TILE(4); break;
                    case 3: Q4_TILE(3); break;
                    case 2: Q4_TILE(2); break;
                    default: Q4_TILE(1); break;
                }
#undef Q4_TILE
            }
        }
    }
}

static void q4_range(const Q4Args *A, const Q4X *X, float *y, int64_t ldy, int64_t M, int64_t p0, int64_t p1) {
    if (A->b8) {
        if (A->zeros != NULL)
            q4_range_(A, X, y, ldy, M, p0, p1, 1, 0, 1);
        else if (A->mins != NULL)
            q4_range_(A, X, y, ldy, M, p0, p1, 0, 1, 1);
        else
            q4_range_(A, X, y, ldy, M, p0, p1, 0, 0, 1);
    } else if (A->zeros != NULL) {
        q4_range_(A, X, y, ldy, M, p0, p1, 1, 0, 0);
    } else if (A->mins != NULL) {
        q4_range_(A, X, y, ldy, M, p0, p1, 0, 1, 0);
    } else {
        q4_range_(A, X, y, ldy, M, p0, p1, 0, 0, 0);
    }
}

/* W4A8 and W8A8g: the activations quantized per row and group (threads over the rows), then the tiles
 * (threads over whole panels, or rows where the panels are fewer). */
/* W4A8 on AMX-INT8 tiles: gemm_amx.c's gemm_amx_w4a8_range (its comment has the contract), given here
 * by worker/gemm_quant_groups.py where the tiles are usable and agree with vpdpbusd, for 4-bit weights
 * without minimums, groups of a multiple of 64 and calls of at least w4a8_tiles_rows rows; NULL:
 * vpdpbusd. The same i_g and group_out, so the same bits either way. */
typedef void (*w4a8_tiles_fn)(const uint8_t *xu, int64_t ldu, const float *sx, const int32_t *xsum, int64_t G,
                              const uint8_t *packed, const uint8_t *zeros, const float *scales, int32_t off,
                              const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                              int64_t group, int64_t nr, int64_t p0, int64_t p1);
static w4a8_tiles_fn w4a8_tiles;
static int64_t w4a8_tiles_rows;

/* Returns 0, or -1 where this build's panels are not the tiles' layout (fn stays NULL). */
int gemm_quant_set_w4a8_tiles(w4a8_tiles_fn fn, int64_t min_rows) {
    if (fn != NULL && !(I8_PATH == 3 && I8_NR == 64)) return -1;
    w4a8_tiles = fn, w4a8_tiles_rows = min_rows;
    return 0;
}

static void group_gemm(const float *x, int64_t ldx, const uint8_t *packed, const uint8_t *zeros,
                       const float *scales, const float *mins, int offset, const float *bias, float *y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K, int64_t group, int num_threads, int b8) {
    const w4a8_tiles_fn tiles =
        !b8 && mins == NULL && group % TILE_K == 0 && M >= w4a8_tiles_rows ? w4a8_tiles : NULL;
    const int64_t K4 = K / 4, ldq = K, G = K / group, panels = (N + I8_NR - 1) / I8_NR;
    /* The tiles read whole 16-row A tiles: TILE_ROWS zero rows past the last (K is a multiple of 64). */
    const int64_t qrows = tiles ? M + TILE_ROWS : M;
    const size_t qbytes = (size_t)(qrows * ldq + 63) / 64 * 64, gbytes = (4 * (size_t)(M * G) + 63) / 64 * 64;
    uint8_t *xq = scratch_for(&quantized, qbytes + 3 * gbytes, "quantized activations");
    float *sx = (float *)(xq + qbytes), *cx = (float *)(xq + qbytes + gbytes);
    int32_t *xsum = (int32_t *)(xq + qbytes + 2 * gbytes);
    const Q4X X = {(const int8_t *)xq, sx, cx, xsum, ldq, G};
    const Q4Args A = {packed, zeros, scales, mins, bias, N, K4, group / 4, G, offset, b8};
    const int64_t units = panels >= num_threads ? panels : (M > panels ? M : panels);
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t lo, hi;
        thread_share(M, &lo, &hi);
        for (int64_t m = lo; m < hi; m++) {
            quant_groups(x + m * ldx, K, group, (int8_t *)xq + m * ldq, sx + m * G, cx + m * G, xsum + m * G);
            /* The tiles take x as the unsigned operand: q + 128, which is q ^ 0x80 in two's complement. */
            if (tiles)
                for (int64_t k = 0; k < K; k++) xq[m * ldq + k] ^= 0x80;
        }
        if (tiles && lo == 0) memset(xq + M * ldq, 0, (size_t)(TILE_ROWS * ldq));
#pragma omp barrier
        int nth = 1;
#ifdef _OPENMP
        nth = omp_get_num_threads();
#endif
        if (panels >= nth) {
            thread_share(panels, &lo, &hi);
            if (tiles)
                tiles(xq, ldq, sx, xsum, G, packed, zeros, scales, offset, bias, y, ldy, M, N, K, group, I8_NR, lo, hi);
            else
                q4_range(&A, &X, y, ldy, M, lo, hi);
        } else {
            thread_share(M, &lo, &hi);
            if (tiles && hi > lo)
                tiles(xq + lo * ldq, ldq, sx + lo * G, xsum + lo * G, G, packed, zeros, scales, offset, bias,
                      y + lo * ldy, ldy, hi - lo, N, K, group, I8_NR, 0, panels);
            else if (!tiles) {
                const Q4X Xm = q4x_rows(X, lo);
                q4_range(&A, &Xm, y + lo * ldy, ldy, hi - lo, 0, panels);
            }
        }
    }
}

/* packed: [ceil(N / I8_NR), K / 4, I8_NV / 2, I8_L * 4] bytes (see above); zeros: NULL or [.., K / group, I8_NR]
 * bytes (zero + offset); scales and mins (NULL or): [.., K / group, I8_NR] float32; offset: 8 (signed q) or 0
 * (unsigned q, with minimums). group: a multiple of 4 dividing K; zeros and mins not both. */
void gemm_w4a8(const float *x, int64_t ldx, const uint8_t *packed, const uint8_t *zeros, const float *scales,
               const float *mins, int offset, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
               int64_t K, int64_t group, int num_threads) {
    group_gemm(x, ldx, packed, zeros, scales, mins, offset, bias, y, ldy, M, N, K, group, num_threads, 0);
}

/* packed: [ceil(N / I8_NR), K / 4, I8_NR, 4] bytes, u = q + 128; zeros: NULL or [.., K / group, I8_NR] bytes
 * (zero + 128); scales and mins (NULL or): [.., K / group, I8_NR] float32. group: a multiple of 4 dividing K,
 * at most 66311; zeros and mins not both. */
void gemm_w8a8g(const float *x, int64_t ldx, const uint8_t *packed, const uint8_t *zeros, const float *scales,
                const float *mins, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                int64_t group, int num_threads) {
    group_gemm(x, ldx, packed, zeros, scales, mins, 128, bias, y, ldy, M, N, K, group, num_threads, 1);
}

/* ---------------------------------------------------------------- weight-only */

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define NR (2 * VL)
#if VL == 16
#define MR 6 /* 2 x 12 sums (the group's and the total) in 32 registers */
#else
#define MR 3 /* 2 x 6 sums in 16 registers */
#endif
#ifndef WQ_WIDEN_TILES
#define WQ_WIDEN_TILES 3 /* row tiles per panel from which a panel is decoded once (measured: 2 loses at 8 rows) */
#endif
#define WQ_MB 192
#define MAGIC 0x4B000000u /* 2^23's bits */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

enum { Q4 = 4, Q8 = 8, FLOAT = 32 };

int64_t gemm_quant_wq_nr(void) { return NR; }

/* VL bytes at p, zero-extended to 32-bit lanes (vpmovzxbd; GCC's __builtin_convertvector of bytes
 * is scalarized, byte by byte). */
static inline __attribute__((always_inline)) vu widen_bytes(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vu out;
    for (int i = 0; i < VL; i++) out[i] = p[i];
    return out;
#endif
}

/* What decoding a panel's group needs: per half of the panel, the float to take off the stored
 * value's 2^23 + u (2^23 + zz: zz the zero point plus the offset, 8 or 128); nothing for 4 bits
 * without zero points on AVX-512 (a table of the 16 values, indexed by the nibble). */
typedef struct {
    vf sub0, sub1;
} Group;

#if defined(__AVX512F__)
#ifndef Q4_TABLE
#define Q4_TABLE 1
#endif
#else
#define Q4_TABLE 0
#endif

static inline __attribute__((always_inline)) Group group_at(const int bits, const int zp, const uint8_t *zeros,
                                                            int64_t g) {
    Group G;
    const vf off = (vf)((vu){0} + (MAGIC | (bits == Q4 ? 8u : 128u)));
    if (bits == Q4 && Q4_TABLE && !zp) { /* the table holds q itself */
        G.sub0 = G.sub1 = (vf){0};
    } else if (zp) {
        G.sub0 = (vf)(widen_bytes(zeros + g * NR) | MAGIC);
        G.sub1 = (vf)(widen_bytes(zeros + g * NR + VL) | MAGIC);
    } else {
        G.sub0 = G.sub1 = off;
    }
    return G;
}

/* k-row k of a panel as two vectors of q - zero (integers, exact in float32). */
static inline __attribute__((always_inline)) void wq_row(const int bits, const int zp, const void *panel, int64_t k,
                                                         const Group *G, vf *w0, vf *w1) {
    (void)zp;
    if (bits == FLOAT) {
        const float *row = (const float *)panel + k * NR;
        *w0 = *(const vf *)row, *w1 = *(const vf *)(row + VL);
    } else if (bits == Q4) {
        const vu b = widen_bytes((const uint8_t *)panel + k * (NR / 2));
#if Q4_TABLE
        if (!zp) {
            /* vpermps reads the low 4 bits of each index lane: the low nibble as it is, the high one shifted
             * down. Measured on Zen 4: faster than the or-and-subtract below without zero points, slower with. */
            const __m512 table = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
            *w0 = (vf)_mm512_permutexvar_ps((__m512i)b, table);
            *w1 = (vf)_mm512_permutexvar_ps((__m512i)(b >> 4), table);
            return;
        }
#endif
        *w0 = (vf)((b & 15u) | MAGIC) - G->sub0;
        *w1 = (vf)((b >> 4) | MAGIC) - G->sub1;
    } else {
        const uint8_t *row = (const uint8_t *)panel + k * NR;
        *w0 = (vf)(widen_bytes(row) | MAGIC) - G->sub0;
        *w1 = (vf)(widen_bytes(row + VL) | MAGIC) - G->sub1;
    }
}

/* One tile: mr rows x np adjacent panels (np * NR features; the first ncols of them stored). Per
 * group, sum_k x * (q - zero) in float32 (one fused multiply-add per k, in order), then
 * total = group sum * scale + total (fused): the documented order, whichever path decodes.
 * panel: the first panel (psize bytes apart, or the decoded float32 panel, np = 1); zeros and
 * scales: the first panel's groups (gsize = K / group * NR apart). */
static inline __attribute__((always_inline)) void wq_tile(
    const int bits, const int zp, const float *x, int64_t ldx, const void *panel, int64_t psize,
    const uint8_t *zeros, const float *scales, int64_t gsize, int64_t K, int64_t group, const float *bias, float *y,
    int64_t ldy, int64_t ncols, const int mr, const int np) {
    vf acc[MR][8], part[MR][8]; /* np <= 4 */
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 2 * np; v++) acc[r][v] = (vf){0};
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        Group G[4];
        if (bits != FLOAT)
            for (int j = 0; j < np; j++) G[j] = group_at(bits, zp, zeros + j * gsize, g);
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < 2 * np; v++) part[r][v] = (vf){0};
        for (int64_t k = k0; k < k0 + group; k++) {
            vf w[8];
            for (int j = 0; j < np; j++)
                wq_row(bits, zp, (const char *)panel + j * psize, k, &G[j], &w[2 * j], &w[2 * j + 1]);
            for (int r = 0; r < mr; r++) {
                const float a = x[r * ldx + k];
                for (int v = 0; v < 2 * np; v++) part[r][v] += a * w[v];
            }
        }
        for (int j = 0; j < np; j++) {
            const float *s = scales + j * gsize + g * NR;
            const vf s0 = *(const vfu *)s, s1 = *(const vfu *)(s + VL);
            for (int r = 0; r < mr; r++) {
                acc[r][2 * j] += part[r][2 * j] * s0;
                acc[r][2 * j + 1] += part[r][2 * j + 1] * s1;
            }
        }
    }
    /* The bias after the sum, as torch's addmm adds it. */
    float b[4 * NR] = {0};
    if (bias != NULL) memcpy(b, bias, sizeof(float) * (size_t)ncols);
    for (int r = 0; r < mr; r++) {
        float out[4 * NR];
        for (int v = 0; v < 2 * np; v++) *(vfu *)(out + v * VL) = acc[r][v] + *(const vfu *)(b + v * VL);
        if (ncols == 2 * np * VL) /* a memcpy of a runtime size is a libc call per row */
            for (int v = 0; v < 2 * np; v++) *(vfu *)(y + r * ldy + v * VL) = *(const vfu *)(out + v * VL);
        else
            memcpy(y + r * ldy, out, sizeof(float) * (size_t)ncols);
    }
}

static _Thread_local Scratch decoded;

/* A panel's q - zero as float32 [K, NR], features in order, into this thread's scratch. */
static const float *decode_panel(const int bits, const int zp, const uint8_t *panel, const uint8_t *zeros, int64_t K,
                                 int64_t group) {
    float *out = scratch_for(&decoded, sizeof(float) * (size_t)(K * NR), "decoded weights");
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        const Group G = group_at(bits, zp, zeros, g);
        for (int64_t k = k0; k < k0 + group; k++) {
            vf w0, w1;
            wq_row(bits, zp, panel, k, &G, &w0, &w1);
            *(vf *)(out + k * NR) = w0, *(vf *)(out + k * NR + VL) = w1;
        }
    }
    return out;
}

/* Panels [p0, p1) for rows [0, M) (M <= WQ_MB). One or two row tiles decode in registers, tile by tile,
 * a single row four panels at a time and two rows two (so that 8 or 16 independent sums hide the
 * latency of the fused multiply-adds); more decode each panel once into scratch and run the float
 * tile loop over it: the same numbers, so the same bits. */
static inline __attribute__((always_inline)) void wq_rows(
    const int bits, const int zp, const float *x, int64_t ldx, const uint8_t *packed, int64_t psize,
    const uint8_t *zeros, const float *scales, int64_t gsize, int64_t M, int64_t N, int64_t K, int64_t group,
    const float *bias, float *y, int64_t ldy, int64_t p0, int64_t p1) {
    const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, taller = M % tiles;
#define WQ_ARGS(P) packed + (P) * psize, psize, zeros == NULL ? NULL : zeros + (P) * gsize, scales + (P) * gsize, gsize
#define WQ_OUT(P, M0, NP) bias == NULL ? NULL : bias + (P) * NR, y + (M0) * ldy + (P) * NR, ldy, \
    min64(N - (P) * NR, (NP) * NR)
    if (M == 1 || M == 2) {
        int64_t p = p0;
        if (M == 1)
            for (; p + 4 <= p1; p += 4) wq_tile(bits, zp, x, ldx, WQ_ARGS(p), K, group, WQ_OUT(p, 0, 4), 1, 4);
        for (; p + 2 <= p1; p += 2) {
            if (M == 1)
                wq_tile(bits, zp, x, ldx, WQ_ARGS(p), K, group, WQ_OUT(p, 0, 2), 1, 2);
            else
                wq_tile(bits, zp, x, ldx, WQ_ARGS(p), K, group, WQ_OUT(p, 0, 2), 2, 2);
        }
        for (; p < p1; p++) {
            if (M == 1)
                wq_tile(bits, zp, x, ldx, WQ_ARGS(p), K, group, WQ_OUT(p, 0, 1), 1, 1);
            else
                wq_tile(bits, zp, x, ldx, WQ_ARGS(p), K, group, WQ_OUT(p, 0, 1), 2, 1);
        }
        return;
    }
    for (int64_t p = p0; p < p1; p++) {
        const int wide = tiles >= WQ_WIDEN_TILES;
        const void *panel = packed + p * psize;
        if (wide) panel = decode_panel(bits, zp, panel, zeros == NULL ? NULL : zeros + p * gsize, K, group);
        for (int64_t t = 0, m = 0; t < tiles; m += base + (t < taller), t++) {
            const int64_t h = base + (t < taller);
            const float *xm = x + m * ldx;
#define WQ_TILE(B, H) wq_tile(B, zp, xm, ldx, panel, psize, zeros == NULL ? NULL : zeros + p * gsize, \
                              scales + p * gsize, gsize, K, group, WQ_OUT(p, m, 1), H, 1)
#if MR > 3
#define WQ_HEIGHTS(B)                    \
    switch (h) {                         \
        case 6: WQ_TILE(B, 6); break;    \
        case 5: WQ_TILE(B, 5); break;    \
        case 4: WQ_TILE(B, 4); break;    \
        case 3: WQ_TILE(B, 3); break;    \
        case 2: WQ_TILE(B, 2); break;    \
        default: WQ_TILE(B, 1); break;   \
    }
#else
#define WQ_HEIGHTS(B)                    \
    switch (h) {                         \
        case 3: WQ_TILE(B, 3); break;    \
        case 2: WQ_TILE(B, 2); break;    \
        default: WQ_TILE(B, 1); break;   \
    }
#endif
            if (wide) {
                WQ_HEIGHTS(FLOAT)
            } else {
                WQ_HEIGHTS(bits)
            }
#undef WQ_HEIGHTS
#undef WQ_TILE
        }
    }
#undef WQ_ARGS
#undef WQ_OUT
}

static inline __attribute__((always_inline)) void wq_range(
    const int bits, const int zp, const float *x, int64_t ldx, const uint8_t *packed, const uint8_t *zeros,
    const float *scales, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group,
    int64_t p0, int64_t p1) {
    const int64_t gsize = K / group * NR, psize = K * (bits == Q4 ? NR / 2 : NR);
    for (int64_t m0 = 0; m0 < M; m0 += WQ_MB)
        wq_rows(bits, zp, x + m0 * ldx, ldx, packed, psize, zeros, scales, gsize, min64(M - m0, WQ_MB), N, K, group,
                bias, y + m0 * ldy, ldy, p0, p1);
}

/* packed: bits 4: [ceil(N / NR), K, NR / 2] bytes (see the top), bits 8: [.., K, NR]; zeros: NULL or
 * [.., K / group, NR] bytes (zero + 8 or + 128); scales: [.., K / group, NR] float32. group divides K. */
void gemm_wq(const float *x, int64_t ldx, const uint8_t *packed, const uint8_t *zeros, const float *scales,
             const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group, int bits,
             int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t units = panels >= num_threads ? panels : (M > panels ? M : panels);
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int nth = 1;
#ifdef _OPENMP
        nth = omp_get_num_threads();
#endif
        int64_t lo, hi, m0 = 0, m1 = M, p0 = 0, p1 = panels;
        thread_share(panels >= nth ? panels : M, &lo, &hi);
        if (panels >= nth)
            p0 = lo, p1 = hi;
        else
            m0 = lo, m1 = hi;
        const float *xm = x + m0 * ldx;
        float *ym = y + m0 * ldy;
        const int64_t rows = m1 - m0;
#define WQ_CALL(B, Z) wq_range(B, Z, xm, ldx, packed, zeros, scales, bias, ym, ldy, rows, N, K, group, p0, p1)
        if (bits == 4 && zeros != NULL)
            WQ_CALL(Q4, 1);
        else if (bits == 4)
            WQ_CALL(Q4, 0);
        else if (zeros != NULL)
            WQ_CALL(Q8, 1);
        else
            WQ_CALL(Q8, 0);
#undef WQ_CALL
    }
}

/* ---------------------------------------------------------------- descriptors */

/* The native decoder driver calls one gemm_fn (decoder_f32.c) per linear layer, its `packed` argument
 * the layer's pointer: for these kernels a descriptor of the packed weight, built once at load by
 * worker/gemm_quant_kernels.py (its ctypes mirror, GemmQuantDesc, must match field for field; the
 * Python side checks the size). `layout` is the packing build's gemm_quant_layout(): a weight packed
 * by one build (panel widths, the W8A8 correction) is refused by another, loudly, rather than read
 * wrong. The entries take any row strides ldx / ldy, any M, and run on any thread (the scratch is
 * per thread). */
#define GQ_MAGIC 0x31445147u /* "GQD1" */
enum { GQ_W8A8 = 1, GQ_WQ = 2, GQ_W4A8 = 3, GQ_W8A8G = 4, GQ_FP8 = 5 };

/* The fp8 kind's GEMM is gemm_fp8() of worker/csrc/gemm_fp8.c, a library of its own, and its
 * descriptor carries that function's address. Compiling it into this file instead would put two
 * kernels that each define their own vector width, tile and panel macros (VL, MR, NR, vf, ...) in
 * one translation unit, and tie the fp8 build to this one's (its tests build it alone for each
 * instruction set). The pointer is the packing build's own kernel (worker/gemm_fp8_kernels.py
 * fills it from the library that packed the panels), so its panel width always matches the
 * weight: no layout check is needed, only that the pointer is there. */
typedef void (*gemm_fp8_fn)(const float *x, int64_t ldx, const uint8_t *packed, const float *scale, const float *bias,
                            float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group, int num_threads);

typedef struct {
    uint32_t magic;
    int32_t kind;            /* GQ_W8A8, GQ_WQ, GQ_W4A8, GQ_W8A8G or GQ_FP8 */
    int32_t layout;          /* gemm_quant_layout() of the build that packed it (fp8: gemm_fp8_layout()'s) */
    int32_t bits;            /* 8 (w8a8), 4 or 8 (wq), 4 (w4a8), 8 (w8a8g, fp8) */
    int64_t n, k, group;     /* group: 0 for w8a8 (one scale per output row) */
    const void *data;        /* the panels */
    const float *scale;      /* w8a8: [panels * NR8]; wq, w4a8, w8a8g, fp8: [panels, K / group, NR] */
    const uint8_t *zero;     /* wq, w4a8, w8a8g: zero points + offset, [panels, K / group, NR] bytes, or NULL */
    const int32_t *corr;     /* w8a8: 128 * sum_k w per feature where the build shifts x, else zeros */
    const float *minimum;    /* w4a8, w8a8g: w = q * scale - minimum ([panels, K / group, NR] float32), or NULL */
    int32_t offset;          /* w4a8: stored u = q + offset (8: signed q; 0: unsigned q with minimums); w8a8g: 128 */
    int32_t reserved;
    gemm_fp8_fn fp8;         /* fp8: the packing build's gemm_fp8; NULL for the other kinds */
} GemmQuantDesc;

int32_t gemm_quant_layout(void) { return (int32_t)(I8_PATH << 16 | I8_NR << 8 | NR); }
int64_t gemm_quant_desc_size(void) { return (int64_t)sizeof(GemmQuantDesc); }

static const GemmQuantDesc *desc_check(const float *packed, int kind, int64_t N, int64_t K) {
    const GemmQuantDesc *d = (const GemmQuantDesc *)(const void *)packed;
    if (d == NULL || d->magic != GQ_MAGIC || d->kind != kind ||
        (kind == GQ_FP8 ? d->fp8 == NULL : d->layout != gemm_quant_layout()) || d->n != N || d->k != K) {
        fprintf(stderr,
                "gemm_quant: descriptor %p does not fit this entry (kind %d, layout %#x, N %lld, K %lld): "
                "kind %d, layout %#x, N %lld, K %lld\n",
                (const void *)d, kind, (unsigned)gemm_quant_layout(), (long long)N, (long long)K,
                d == NULL ? -1 : d->kind, d == NULL ? 0u : (unsigned)d->layout, d == NULL ? -1LL : (long long)d->n,
                d == NULL ? -1LL : (long long)d->k);
        abort();
    }
    return d;
}

/* K = 0: y = bias (or 0). */
static void desc_empty(const float *bias, float *y, int64_t ldy, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias == NULL ? 0.0f : bias[n];
}

void gemm_w8a8_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = desc_check(packed, GQ_W8A8, N, K);
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        desc_empty(bias, y, ldy, M, N);
        return;
    }
    gemm_w8a8(x, ldx, (const int8_t *)d->data, d->corr, d->scale, bias, y, ldy, M, N, K,
              num_threads < 1 ? 1 : num_threads);
}

void gemm_wq_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                  int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = desc_check(packed, GQ_WQ, N, K);
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        desc_empty(bias, y, ldy, M, N);
        return;
    }
    gemm_wq(x, ldx, (const uint8_t *)d->data, d->zero, d->scale, bias, y, ldy, M, N, K, d->group, d->bits,
            num_threads < 1 ? 1 : num_threads);
}

void gemm_w4a8_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = desc_check(packed, GQ_W4A8, N, K);
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        desc_empty(bias, y, ldy, M, N);
        return;
    }
    gemm_w4a8(x, ldx, (const uint8_t *)d->data, d->zero, d->scale, d->minimum, d->offset, bias, y, ldy, M, N, K,
              d->group, num_threads < 1 ? 1 : num_threads);
}

void gemm_w8a8g_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = desc_check(packed, GQ_W8A8G, N, K);
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        desc_empty(bias, y, ldy, M, N);
        return;
    }
    gemm_w8a8g(x, ldx, (const uint8_t *)d->data, d->zero, d->scale, d->minimum, bias, y, ldy, M, N, K, d->group,
               num_threads < 1 ? 1 : num_threads);
}

void gemm_fp8_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = desc_check(packed, GQ_FP8, N, K);
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        desc_empty(bias, y, ldy, M, N);
        return;
    }
    d->fp8(x, ldx, (const uint8_t *)d->data, d->scale, bias, y, ldy, M, N, K, d->group,
           num_threads < 1 ? 1 : num_threads);
}

/* Any of the above, by the descriptor's own kind: the decoder driver calls one GEMM entry per model,
 * and a GGUF file mixes types layer by layer (Q4_K beside Q6_K in a Q4_K_M), so a model whose
 * layers are all quantized, in whatever kinds, runs on the driver through this one. */
void gemm_quant_desc(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
    const GemmQuantDesc *d = (const GemmQuantDesc *)(const void *)packed;
    switch (d == NULL || d->magic != GQ_MAGIC ? 0 : d->kind) {
    case GQ_W8A8: gemm_w8a8_desc(x, ldx, packed, bias, y, ldy, M, N, K, num_threads); break;
    case GQ_WQ: gemm_wq_desc(x, ldx, packed, bias, y, ldy, M, N, K, num_threads); break;
    case GQ_W4A8: gemm_w4a8_desc(x, ldx, packed, bias, y, ldy, M, N, K, num_threads); break;
    case GQ_W8A8G: gemm_w8a8g_desc(x, ldx, packed, bias, y, ldy, M, N, K, num_threads); break;
    case GQ_FP8: gemm_fp8_desc(x, ldx, packed, bias, y, ldy, M, N, K, num_threads); break;
    default: desc_check(packed, -1, N, K); /* prints what it found, and aborts */
    }
}
