/* Float32 y = x @ W^T (+ bias) over bfloat16 or float16 weights, for the CPU
 * linear layers.
 *
 * Decode on a CPU is bound by the weight bytes read per step; checkpoints ship
 * in bfloat16 (some in float16), and keeping W in 16 bits halves those bytes
 * against gemm_f32.c. Three kernels share one blocking (gemm_f32.c's, read that first: W packed once
 * into panels of NR output features, k-major, so the MR x NR accumulators of a
 * row tile stay in registers for the whole K loop; near-equal row tiles; each
 * tile prefetching its share of the next panel; threads splitting panels,
 * never K, so the result depends on neither the thread count nor the batch's
 * other rows):
 *
 * - "widen" (every CPU): the arithmetic stays float32. A bf16 value is the top
 *   16 bits of a float32, so widening it is a shift (or a mask) in registers,
 *   exact, and each output is the same in-order float32 fused sum over k as
 *   gemm_f32.c computes on the bf16-rounded weight, bit for bit. Within a
 *   panel's k-row the two vectors' weights are interleaved: 16-bit element 2i
 *   holds feature i (of the first vector) and 2i + 1 feature VL + i (of the
 *   second). One VL x 32-bit load then carries both vectors, and on a
 *   little-endian CPU lane i is (feature VL + i) << 16 | feature i, so the
 *   first vector is lane << 16 and the second lane & 0xffff0000: one load and
 *   two one-cycle bit operations per k.
 *
 * - "dot" (AVX512_BF16): x is rounded to bf16 (nearest even, as torch does)
 *   and vdpbf16ps multiplies a pair of k per lane, 32 products per instruction
 *   against an FMA's 16: twice the arithmetic rate, which is what a batched
 *   step is bound by once the weights are half the bytes. A panel's rows are
 *   pairs of k (k even in the low half of each 32-bit lane, as the instruction
 *   pairs them), one vector per VL features; x's pair for a row is one 32-bit
 *   broadcast. Each output is one in-order float32 sum over the k pairs, so
 *   it is still independent of threads and of the other rows, but it is not
 *   the widened kernel's result (x is rounded, and k is summed in pairs).
 *
 * - "f16" (every x86-64-v3 CPU: F16C, or AVX-512F): float16 weights widened
 *   to float32 by vcvtph2ps, exact, so again each output is gemm_f32.c's sum
 *   over the f16-rounded weight, bit for bit. A k-row is the panel's NR
 *   features in order (the conversion reads VL contiguous halves).
 *
 * The ISA is the compiler's: GCC vector types, compiled with -march=native
 * (or x86-64-v3 in the tests), become 8-wide AVX2 or 16-wide AVX-512 code with
 * FMA; the dot kernel exists where -march=native names AVX512_BF16, which the
 * loader reports (gemm_bf16_dot_built) and the Python side chooses from.
 *
 * x:      [M, K] float32, row stride ldx
 * packed: widen: [ceil(N / NR), K, NR] bf16 bits (uint16), interleaved as above
 *         dot:   [ceil(N / NR), ceil(K / 2), NR, 2] bf16 bits, k odd padded with 0
 *         f16:   [ceil(N / NR), K, NR] float16 bits, features in order
 *         the tail panel zero-padded
 * bias:   [N] float32 or NULL
 * y:      [M, N] float32, row stride ldy
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the interleaved panels assume a little-endian CPU"
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define NR (2 * VL)
#define MR 6          /* the switch in panel_rows names every height 1..MR */
#define LINE 32       /* bf16 values per 64-byte cache line */
#ifndef WIDEN_ONCE_TILES
#define WIDEN_ONCE_TILES 4 /* tiles per panel from which a widening kernel widens the panel once (measured: 2-3 lose at 8-13 rows) */
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

/* The kernels, by the layout of the panels they read; FLOAT is a WIDEN or F16
 * panel widened once into scratch (panel_rows). */
enum { WIDEN, DOT, F16, FLOAT };

int64_t gemm_bf16_nr(void) { return NR; }

int gemm_bf16_dot_built(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Where a tile's prefetches of the next panel go: one row of `row` bf16 values at
 * *q every `every` steps of the K loop. */
typedef struct {
    const uint16_t *q;
    int64_t every, row;
} Prefetch;

static inline __attribute__((always_inline)) void prefetch_step(Prefetch *pf, int64_t *countdown) {
    if (--*countdown == 0) {
        *countdown = pf->every;
        /* At VL = 8 a widen k-row is half a line: the second prefetch of a line
         * is a cheap hit, and keeps the schedule gemm_f32.c measured. */
        for (int l = 0; l < pf->row; l += LINE) __builtin_prefetch(pf->q + l, 0, 2);
        pf->q += pf->row;
    }
}

static inline __attribute__((always_inline)) void bias_vectors(const float *bias, int64_t ncols, vf *b0, vf *b1) {
    *b0 = (vf){0}, *b1 = (vf){0};
    if (bias != NULL) {
        float tmp[NR] = {0};
        memcpy(tmp, bias, sizeof(float) * (size_t)ncols);
        *b0 = *(const vfu *)tmp;
        *b1 = *(const vfu *)(tmp + VL);
    }
}

/* The bias is added after the sum, as torch's addmm does (beta * bias + x @ W^T). */
static inline __attribute__((always_inline)) void store_tile(
    const vf *acc0, const vf *acc1, vf b0, vf b1, float *y, int64_t ldy, int64_t ncols, const int mr) {
    for (int r = 0; r < mr; r++) {
        vf o0 = acc0[r] + b0, o1 = acc1[r] + b1;
        float *out = y + r * ldy;
        if (ncols == NR) {
            *(vfu *)out = o0;
            *(vfu *)(out + VL) = o1;
        } else {
            float tmp[NR];
            *(vfu *)tmp = o0;
            *(vfu *)(tmp + VL) = o1;
            memcpy(out, tmp, sizeof(float) * (size_t)ncols);
        }
    }
}

/* float16 bits -> float32, exact; the portable path for a compiler without F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | man << 13;            /* inf, NaN (payload kept) */
    } else if (exp != 0) {
        u = sign | (exp + 112) << 23 | man << 13;        /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        u = sign;                                        /* zero */
    } else {                                             /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do e++, m <<= 1; while (!(m & 0x400u));
        u = sign | (uint32_t)(112 - e) << 23 | (m & 0x3ffu) << 13;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* VL float16 values at p, widened. */
static inline __attribute__((always_inline)) vf widen_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VL == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf out;
    for (int i = 0; i < VL; i++) out[i] = half_to_float(p[i]);
    return out;
#endif
}

/* k-row k of a widening layout's panel as two float32 vectors: WIDEN's interleaved
 * bf16 pairs (lane i is (feature VL + i) << 16 | feature i), F16's halves in order,
 * FLOAT's floats in order. */
static inline __attribute__((always_inline)) void widened_row(const int layout, const void *panel, int64_t k,
                                                             vf *w0, vf *w1) {
    if (layout == FLOAT) {
        const float *row = (const float *)panel + k * NR;
        *w0 = *(const vf *)row, *w1 = *(const vf *)(row + VL);
    } else if (layout == F16) {
        const uint16_t *row = (const uint16_t *)panel + k * NR;
        *w0 = widen_f16(row), *w1 = widen_f16(row + VL);
    } else {
        const vu pair = *(const vu *)((const uint16_t *)panel + k * NR);
        *w0 = (vf)(pair << 16); /* a vector cast reinterprets the bits */
        *w1 = (vf)(pair & 0xffff0000u);
    }
}

/* One MR' x NR tile of a widening kernel (MR' = mr <= MR and the layout literals at
 * every call site, so that the row loops unroll and the accumulators live in registers). */
static inline __attribute__((always_inline)) void tile_widening(
    const int layout, const float *x, int64_t ldx, const void *panel, int64_t K, const float *bias, float *y,
    int64_t ldy, int64_t ncols, const int mr, Prefetch *pf) {
    vf acc0[MR], acc1[MR], b0, b1;
    bias_vectors(bias, ncols, &b0, &b1);
    int64_t countdown = pf->every;
    for (int r = 0; r < mr; r++) acc0[r] = (vf){0}, acc1[r] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        prefetch_step(pf, &countdown);
        vf w0, w1;
        widened_row(layout, panel, k, &w0, &w1);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * ldx + k];
            acc0[r] += a * w0;
            acc1[r] += a * w1;
        }
    }
    store_tile(acc0, acc1, b0, b1, y, ldy, ncols, mr);
}

#define SCRATCH_OWNER "gemm_bf16"
#include "thread_scratch.h"

static _Thread_local Scratch widened;

/* A WIDEN or F16 panel as float32 [K, NR], features in order, into this thread's scratch. */
static const float *widen_panel(const int layout, const uint16_t *panel, int64_t K) {
    float *out = scratch_for(&widened, sizeof(float) * (size_t)(K * NR), "widened weights");
    for (int64_t k = 0; k < K; k++) {
        vf w0, w1;
        if (layout == F16)
            widened_row(F16, panel, k, &w0, &w1);
        else
            widened_row(WIDEN, panel, k, &w0, &w1);
        *(vf *)(out + k * NR) = w0;
        *(vf *)(out + k * NR + VL) = w1;
    }
    return out;
}

#ifdef __AVX512BF16__
/* One tile of the dot kernel: x2 holds x's rows as bf16 pairs (K2 = ceil(K / 2) per row). */
static inline __attribute__((always_inline)) void tile_dot(
    const uint32_t *x2, int64_t ldx2, const uint16_t *panel, int64_t K2, const float *bias, float *y, int64_t ldy,
    int64_t ncols, const int mr, Prefetch *pf) {
    __m512 acc0[MR], acc1[MR];
    vf b0, b1;
    bias_vectors(bias, ncols, &b0, &b1);
    int64_t countdown = pf->every;
    for (int r = 0; r < mr; r++) acc0[r] = _mm512_setzero_ps(), acc1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; k++) {
        prefetch_step(pf, &countdown);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * NR + NR);
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x2[r * ldx2 + k]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], a, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], a, w1);
        }
    }
    vf out0[MR], out1[MR];
    for (int r = 0; r < mr; r++) out0[r] = (vf)acc0[r], out1[r] = (vf)acc1[r];
    store_tile(out0, out1, b0, b1, y, ldy, ncols, mr);
}
#endif

/* One tile of height h of the kernel for `layout` (a constant at every call). */
static inline __attribute__((always_inline)) void tile(
    const int layout, const void *x, int64_t ldx, const void *panel, int64_t steps, const float *bias, float *y,
    int64_t ldy, int64_t ncols, const int mr, Prefetch *pf) {
#ifdef __AVX512BF16__
    if (layout == DOT) {
        tile_dot((const uint32_t *)x, ldx, panel, steps, bias, y, ldy, ncols, mr, pf);
        return;
    }
#endif
    tile_widening(layout, (const float *)x, ldx, panel, steps, bias, y, ldy, ncols, mr, pf);
}

/* The tiles of M rows against one panel: heights h near-equal, each a literal
 * at its call. */
#define TILE_ROWS(LAYOUT, PANEL)                                                                   \
    for (int64_t t = 0, m = 0; t < tiles; m += base + (t < taller), t++) {                         \
        const int64_t h = base + (t < taller);                                                     \
        const char *xm = x + m * ldx * 4;                                                          \
        float *ym = y + m * ldy;                                                                   \
        switch (h) {                                                                               \
            case 6: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 6, &pf); break;      \
            case 5: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 5, &pf); break;      \
            case 4: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 4, &pf); break;      \
            case 3: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 3, &pf); break;      \
            case 2: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 2, &pf); break;      \
            default: tile(LAYOUT, xm, ldx, PANEL, steps, bias, ym, ldy, ncols, 1, &pf); break;     \
        }                                                                                          \
    }

/* All M rows against one panel, in ceil(M / MR) tiles of near-equal height;
 * meanwhile the tiles prefetch `next` (the panel this thread computes next),
 * each tile about steps / tiles of its rows, one every `tiles` steps.
 * x's elements are 4 bytes in every kernel (a float, a pair of bf16).
 * A widening kernel's panel met by several tiles is widened once, into
 * scratch, and the tiles read float32: each tile converting the whole panel
 * again cost f16 a fifth of its speed from 32 rows on. The sums are the same
 * (the conversion is exact), so the bits are too. */
static inline __attribute__((always_inline)) void panel_rows(
    const int layout, const char *x, int64_t ldx, const uint16_t *panel, int64_t M, int64_t steps, const float *bias,
    float *y, int64_t ldy, int64_t ncols, const uint16_t *next) {
    const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, taller = M % tiles;
    /* At 1-2 rows the hardware prefetcher streams best alone (gemm_f32.c's
     * measurement); steps + 1 never comes round. */
    Prefetch pf = {next, M >= 3 ? tiles : steps + 1, layout == DOT ? 2 * NR : NR};
    if (layout != DOT && tiles >= WIDEN_ONCE_TILES) {
        const float *wide = widen_panel(layout, panel, steps);
        TILE_ROWS(FLOAT, wide)
    } else {
        TILE_ROWS(layout, panel)
    }
}

/* Panels [p0, p1) for rows [0, M), in blocks of MB rows; a panel is `psize` bf16 values. */
static inline __attribute__((always_inline)) void panel_range(
    const int layout, const char *x, int64_t ldx, const uint16_t *packed, int64_t psize, int64_t steps,
    const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t p0, int64_t p1) {
    /* Panels inner, so a panel is read from memory once per block of rows;
     * blocks of MB rows keep a long prefill's rows in L3 (see gemm_f32.c). */
    const int64_t MB = 192;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0 < MB ? M - m0 : MB;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            const int64_t pn = p + 1 < p1 ? p + 1 : (m0 + MB < M ? p0 : p);
            panel_rows(layout, x + m0 * ldx * 4, ldx, packed + p * psize, rows, steps,
                       bias == NULL ? NULL : bias + n0, y + m0 * ldy + n0, ldy, ncols, packed + pn * psize);
        }
    }
}

/* A contiguous run of panels per thread: one sequential weight stream. */
static inline int threads_for(int64_t panels, int num_threads) {
    return panels < num_threads ? (int)panels : num_threads;
}

/* The calling thread's share [*lo, *hi) of n items, inside a parallel region (all of them outside). */
static inline void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t tid = 0, nth = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    nth = omp_get_num_threads();
#endif
    *lo = n * tid / nth, *hi = n * (tid + 1) / nth;
}

/* A widening kernel's whole product, its panels split over the threads. */
static inline __attribute__((always_inline)) void widening_gemm(
    const int layout, const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
    int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    const int threads = threads_for(panels, num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t p0, p1;
        thread_share(panels, &p0, &p1);
        panel_range(layout, (const char *)x, ldx, packed, K * NR, K, bias, y, ldy, M, N, p0, p1);
    }
}

void gemm_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
               int64_t M, int64_t N, int64_t K, int num_threads) {
    widening_gemm(WIDEN, x, ldx, packed, bias, y, ldy, M, N, K, num_threads);
}

/* Panels [p0, p1) of the product on the calling thread alone: for a caller that
 * splits the work of many GEMMs over its own threads (moe_f32.c's experts). */
void gemm_bf16_panels(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                      int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    panel_range(WIDEN, (const char *)x, ldx, packed, K * NR, K, bias, y, ldy, M, N, p0, p1);
}

#ifdef __AVX512BF16__
#include "bf16_round.h"

/* x's rows [m0, m1) as bf16 pairs: k even in the low half, an odd K's last pair padded with 0. */
static void round_rows(const float *x, int64_t ldx, uint32_t *x2, int64_t K, int64_t m0, int64_t m1) {
    const int64_t K2 = (K + 1) / 2;
    for (int64_t m = m0; m < m1; m++) round_pairs(x + m * ldx, x2 + m * K2, K);
}

/* The rounded x lives in one buffer per calling thread. */
static _Thread_local Scratch rounded;
#endif

/* Same arguments as gemm_bf16; `packed` in the dot layout (pack_bf16_dot). */
void gemm_bf16_dot(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
#ifdef __AVX512BF16__
    const int64_t panels = (N + NR - 1) / NR, K2 = (K + 1) / 2;
    uint32_t *x2 = scratch_for(&rounded, sizeof(uint32_t) * (size_t)(M * K2), "rounded activations");
    const int threads = threads_for(panels, num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t m0, m1, p0, p1;
        thread_share(M, &m0, &m1);
        round_rows(x, ldx, x2, K, m0, m1);
#pragma omp barrier
        thread_share(panels, &p0, &p1);
        panel_range(DOT, (const char *)x2, K2, packed, K2 * 2 * NR, K2, bias, y, ldy, M, N, p0, p1);
    }
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    fprintf(stderr, "gemm_bf16_dot: built without AVX512_BF16 (check gemm_bf16_dot_built)\n");
    abort();
#endif
}

/* W [N, K] as bf16 bits, row stride ldw, into `packed` (ceil(N / NR) * K * NR
 * values). The caller rounds a float32 W to bf16 (torch rounds to nearest even). */
void pack_bf16(const uint16_t *w, int64_t ldw, int64_t N, int64_t K, uint16_t *packed, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 1) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * K * NR;
        memset(dst, 0, sizeof(uint16_t) * (size_t)(K * NR));
        for (int j = 0; j < NR; j++) {
            const int64_t n = p * NR + j;
            if (n >= N) break;
            /* Feature j of the panel goes to 16-bit slot 2j (first vector) or
             * 2(j - VL) + 1 (second vector) of every k-row. */
            const int64_t slot = j < VL ? 2 * j : 2 * (j - VL) + 1;
            const uint16_t *src = w + n * ldw;
            for (int64_t k = 0; k < K; k++) dst[k * NR + slot] = src[k];
        }
    }
}

/* gemm_bf16_panels over the dot layout: the caller's thread rounds its rows of x itself. */
void gemm_bf16_dot_panels(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                          int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
#ifdef __AVX512BF16__
    const int64_t K2 = (K + 1) / 2;
    uint32_t *x2 = scratch_for(&rounded, sizeof(uint32_t) * (size_t)(M * K2), "rounded activations");
    round_rows(x, ldx, x2, K, 0, M);
    panel_range(DOT, (const char *)x2, K2, packed, K2 * 2 * NR, K2, bias, y, ldy, M, N, p0, p1);
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)p0, (void)p1;
    fprintf(stderr, "gemm_bf16_dot_panels: built without AVX512_BF16 (check gemm_bf16_dot_built)\n");
    abort();
#endif
}

/* The same W into the dot layout (ceil(N / NR) * ceil(K / 2) * 2 * NR values):
 * feature j's (k, k + 1) pair is 32-bit lane j of pair-row k / 2. */
void pack_bf16_dot(const uint16_t *w, int64_t ldw, int64_t N, int64_t K, uint16_t *packed, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR, K2 = (K + 1) / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 1) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * K2 * 2 * NR;
        memset(dst, 0, sizeof(uint16_t) * (size_t)(K2 * 2 * NR));
        for (int j = 0; j < NR; j++) {
            const int64_t n = p * NR + j;
            if (n >= N) break;
            const uint16_t *src = w + n * ldw;
            for (int64_t k = 0; k < K; k++) dst[(k / 2) * 2 * NR + 2 * j + k % 2] = src[k];
        }
    }
}

/* The f16 kernel: gemm_bf16's arguments, `packed` in the f16 layout (pack_f16). */
void gemm_f16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
              int64_t M, int64_t N, int64_t K, int num_threads) {
    widening_gemm(F16, x, ldx, packed, bias, y, ldy, M, N, K, num_threads);
}

void gemm_f16_panels(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    panel_range(F16, (const char *)x, ldx, packed, K * NR, K, bias, y, ldy, M, N, p0, p1);
}

/* W [N, K] as float16 bits, row stride ldw, into the f16 layout (ceil(N / NR) * K * NR values). */
void pack_f16(const uint16_t *w, int64_t ldw, int64_t N, int64_t K, uint16_t *packed, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 1) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * K * NR;
        memset(dst, 0, sizeof(uint16_t) * (size_t)(K * NR));
        for (int j = 0; j < NR && p * NR + j < N; j++) {
            const uint16_t *src = w + (p * NR + j) * ldw;
            for (int64_t k = 0; k < K; k++) dst[k * NR + j] = src[k];
        }
    }
}
