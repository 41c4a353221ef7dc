/* Float32 y = x @ W^T (+ bias) over FP8 (e4m3fn) weights, for the CPU linear layers of
 * FP8 checkpoints: the weights stay one byte each and are widened in registers as the K loop
 * meets them (activation scales of the checkpoint are not applied: the CPU computes with float
 * or bf16 activations, finer than the e4m3 ones the checkpoint was calibrated for). Read
 * gemm_f32.c and gemm_quant.c first: the blocking is theirs (W packed once at load into panels
 * of NR output features, k-major, so an MR x NR tile of accumulators stays in registers for the
 * whole K loop; near-equal row tiles; threads split whole panels, or rows, never K, so no output
 * depends on the thread count or on the batch's other rows).
 *
 * Two layouts (compile time, the build's -march: worker/native_build.py builds with
 * -march=native, NORIA_CPU_MARCH builds another host's):
 *
 * - "dot" (AVX512_BF16 with AVX512_VBMI: Zen 4 and later, Sapphire Rapids and later): the bytes
 *   widen to bf16 and vdpbf16ps multiplies them with x rounded to bf16, a pair of k per 32-bit
 *   lane, 32 products per instruction against an FMA's 16. Once the weights are a quarter of
 *   float32's bytes, a step of 16 rows or more is bound by that arithmetic, not by the bytes.
 *   Every e4m3 value is a bf16 value (3 mantissa bits of bf16's 7; the exponents, subnormal
 *   e4m3 included, are normal bf16 exponents), so the widening is exact: two 128-byte tables
 *   (the bf16's low and high bytes by the byte's seven magnitude bits) looked up 64 bytes at a
 *   time by vpermt2b, the sign or-ed into the high byte, and the two halves interleaved by
 *   vpunpck{l,h}bw into two vectors of 16 (k, k + 1) pairs. A panel's pair-row holds its 64
 *   bytes in the order that interleave wants (PackedFp8Weight's pack says which byte is where).
 *   The tables hold w * 2^-8 (exact and normal in bf16), so the scales are the widening
 *   layout's. x is rounded to bf16 (nearest even, gemm_bf16.c's rule) once per call, each row
 *   on its own, into a per-thread scratch.
 *   Without VBMI (Cooper Lake) there is no one-instruction 128-byte lookup: "widen" there.
 *
 * - "widen" (every other build): x stays float32 and each byte is widened to float32. An e4m3
 *   byte b (sign, 4 exponent bits of bias 7, 3 mantissa bits) is exactly the half-precision
 *   number with bits ((b & 0x80) << 8) | ((b & 0x7f) << 7) times 2^8, normals and subnormals
 *   alike (half's exponent field is one bit wider, bias 15: 2^(15 - 7) apart, and a subnormal
 *   e4m3 m * 2^-9 is the subnormal half m * 2^-17). In registers: sign-extend the bytes to 16
 *   bits (vpmovsxbw), shift left by 7, keep the sign and the seven value bits (and 0xBF80: the
 *   sign extension's ones above them go), then vcvtph2ps to float32, exact (every half is a
 *   normal float32). No float32 subnormals appear, so no microcode assists. Paths: AVX-512F (16
 *   floats per vector, 6-row tiles), AVX2 with F16C and FMA (8 floats, 4-row tiles), portable C
 *   (a 256-entry table).
 *
 * On both, the 2^8 is folded into the scales at pack time (exact: a power of two). The bytes 0x7f
 * and 0xff (NaN in e4m3fn) would widen to +-480: the Python side refuses weights holding them.
 *
 * The sums, per output (row m, feature n), with w' = the widened value (w * 2^-8) and
 * s' = 256 * the float32 scale of (n, group g):
 *   widen: part_g = sum over k of group g, in order, of x[m, k] * w'[n, k]   (fmaf each, from 0)
 *   dot:   part_g = sum over the pairs (k, k + 1) of group g, in order, of bf16(x[m, k]) * w'[n, k]
 *          + bf16(x[m, k + 1]) * w'[n, k + 1]   (one vdpbf16ps each, from 0; a group of odd
 *          length ends in a pair padded with zeros)
 *   both:  tot = fmaf(part_g, s'_g, tot) over g in order, from 0;  y = tot + bias[n]
 * One group (per-channel or per-tensor scales) is group = K. Every product is exact. Widen: each
 * step is one fused multiply-add on every path (vfmadd on AVX-512 and AVX2, libm's fmaf in the
 * portable C), so every widening build gives the same bits. Dot: the two products of a pair are
 * added to the sum by one instruction, with that instruction's roundings (Intel defines the odd
 * k's product added first, then the even's, each rounded to nearest even) and with subnormal
 * inputs and results flushed to zero; so its bits are the same for any thread count and batch
 * on one CPU, but they are not the widening builds' (x rounded, k summed in pairs).
 *
 * Panels: widen [ceil(N / NR), K, NR] bytes; dot [ceil(N / NR), K / group, ceil(group / 2), NR, 2]
 * bytes, each pair-row's 2 * NR bytes permuted as above; NR = 2 vectors, the tail panel padded
 * with zero bytes (0.0). Scales [ceil(N / NR), K / group, NR] float32. gemm_fp8_layout() tells the
 * two apart.
 *
 * The native decoder driver (decoder_f32.c) reaches gemm_fp8 through gemm_quant.c's descriptor
 * dispatcher: a packed weight's GemmQuantDesc of kind fp8 holds this function's address.
 *
 * x:  [M, K] float32, row stride ldx;  y: [M, N] float32, row stride ldy;  bias: [N] or NULL.
 */
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

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define F8_DOT 1
#else
#define F8_DOT 0
#endif

#if defined(__AVX512F__)
#define F8_PATH 2 /* avx512 */
#define VL 16
#define MR 6
typedef __m512 vf;
static inline __attribute__((always_inline)) vf vzero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf vset1(float a) { return _mm512_set1_ps(a); }
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf widen(const uint8_t *p) {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16((short)0xBF80)));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define F8_PATH 1 /* avx2 */
#define VL 8
#define MR 4
typedef __m256 vf;
static inline __attribute__((always_inline)) vf vzero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf vset1(float a) { return _mm256_set1_ps(a); }
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf widen(const uint8_t *p) {
    int64_t bytes;
    memcpy(&bytes, p, 8);
    const __m128i s = _mm_cvtepi8_epi16(_mm_cvtsi64_si128(bytes));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16((short)0xBF80)));
}
#else
#define F8_PATH 0 /* portable */
#define VL 8
#define MR 4
typedef struct {
    float v[VL];
} vf;
/* The widened values w * 2^-8 by byte, made on first use (the same numbers the vector paths make). */
static float f8_table[256];
static int f8_table_ready;
static void f8_table_init(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7 - 8) : ldexpf((float)m / 8.0f, -6 - 8);
        f8_table[b] = (b & 0x80) ? -mag : mag;
    }
    __atomic_store_n(&f8_table_ready, 1, __ATOMIC_RELEASE);
}
static inline vf vzero(void) { return (vf){{0}}; }
static inline vf vset1(float a) {
    vf r;
    for (int i = 0; i < VL; i++) r.v[i] = a;
    return r;
}
static inline vf vload(const float *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void vstore(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vfma(vf a, vf b, vf c) {
    for (int i = 0; i < VL; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
static inline vf widen(const uint8_t *p) {
    vf r;
    for (int i = 0; i < VL; i++) r.v[i] = f8_table[p[i]];
    return r;
}
#endif

#define NR (2 * VL)
#define MB 64 /* rows per block: a block of x stays in L2 while the panels pass */

int gemm_fp8_isa(void) { return F8_PATH; }
int gemm_fp8_dot_built(void) { return F8_DOT; }
int64_t gemm_fp8_nr(void) { return NR; }
/* What a packed weight's descriptor records of the build that packed it (gemm_quant.c's GemmQuantDesc.layout). */
int32_t gemm_fp8_layout(void) { return (int32_t)(F8_DOT << 16 | F8_PATH << 8 | NR); }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The calling thread's share [*lo, *hi) of n items, inside a parallel region (all of them outside). */
static inline void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t tid = 0, nth = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    nth = omp_get_num_threads();
#endif
    *lo = n * tid / nth, *hi = n * (tid + 1) / nth;
}

/* H rows of x against one panel: the sums of the top of the file, the group totals kept in `tot`
 * (memory: they change once per group, and the registers hold the running parts). */
static inline __attribute__((always_inline)) void f8_tile(const float *restrict x, int64_t ldx,
                                                          const uint8_t *restrict panel,
                                                          const float *restrict scale, const float *restrict bias,
                                                          float *restrict y, int64_t ldy, int64_t ncols, int64_t K,
                                                          int64_t group, const int H) {
    float tot[MR][NR];
    for (int r = 0; r < H; r++) memset(tot[r], 0, sizeof tot[r]);
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        vf acc[MR][2];
        for (int r = 0; r < H; r++) acc[r][0] = acc[r][1] = vzero();
        const uint8_t *wk = panel + g0 * NR;
        for (int64_t k = g0; k < g0 + group; k++, wk += NR) {
            const vf w0 = widen(wk), w1 = widen(wk + VL);
            for (int r = 0; r < H; r++) {
                const vf xr = vset1(x[r * ldx + k]);
                acc[r][0] = vfma(xr, w0, acc[r][0]);
                acc[r][1] = vfma(xr, w1, acc[r][1]);
            }
        }
        const float *s = scale + g0 / group * NR;
        const vf s0 = vload(s), s1 = vload(s + VL);
        for (int r = 0; r < H; r++) {
            vstore(tot[r], vfma(acc[r][0], s0, vload(tot[r])));
            vstore(tot[r] + VL, vfma(acc[r][1], s1, vload(tot[r] + VL)));
        }
    }
    for (int r = 0; r < H; r++) {
        float *yr = y + r * ldy;
        if (bias == NULL && ncols == NR) { /* a memcpy of a runtime size is a libc call per row */
            vstore(yr, vload(tot[r]));
            vstore(yr + VL, vload(tot[r] + VL));
        } else if (bias == NULL) {
            memcpy(yr, tot[r], sizeof(float) * (size_t)ncols);
        } else {
            for (int64_t c = 0; c < ncols; c++) yr[c] = tot[r][c] + bias[c];
        }
    }
}

#if !F8_DOT
/* Rows [0, M) against panels [p0, p1), in blocks of MB rows, each block's row tiles of near-equal height. */
static void f8_range(const float *x, int64_t ldx, const uint8_t *packed, const float *scale, const float *bias,
                     float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group, int64_t p0, int64_t p1) {
    const int64_t G = K / group;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = min64(M - m0, MB);
        const int64_t tiles = (rows + MR - 1) / MR, base = rows / tiles, taller = rows % tiles;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * NR, ncols = min64(N - n0, NR);
            const uint8_t *panel = packed + p * K * NR;
            const float *s = scale + p * G * NR, *b = bias == NULL ? NULL : bias + n0;
            for (int64_t t = 0, m = m0; t < tiles; m += base + (t < taller), t++) {
                const int64_t h = base + (t < taller);
                const float *xm = x + m * ldx;
                float *ym = y + m * ldy + n0;
#define F8_TILE(H) f8_tile(xm, ldx, panel, s, b, ym, ldy, ncols, K, group, H)
                switch (h) {
#if MR > 4
                    case 6: F8_TILE(6); break;
                    case 5: F8_TILE(5); break;
#endif
                    case 4: F8_TILE(4); break;
                    case 3: F8_TILE(3); break;
                    case 2: F8_TILE(2); break;
                    default: F8_TILE(1); break;
                }
#undef F8_TILE
            }
        }
    }
}
#endif

#if F8_DOT
#define PAIR_ROW (2 * NR) /* bytes of a dot panel's pair-row: NR features x (k, k + 1) */

/* The bf16 bits of |w| * 2^-8 by the byte's seven magnitude bits, low and high bytes apart
 * (vpermt2b's 128-byte table is two vectors), made on first use. */
static uint8_t f8_lo[128] __attribute__((aligned(64))), f8_hi[128] __attribute__((aligned(64)));
static int f8_bf16_ready;
static void f8_bf16_init(void) {
    for (int b = 0; b < 128; b++) {
        const int e = b >> 3, m = b & 7;
        const float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7 - 8) : ldexpf((float)m / 8.0f, -6 - 8);
        uint32_t u;
        memcpy(&u, &mag, sizeof u); /* the low 16 bits are 0: |w| * 2^-8 is a bf16 value */
        f8_lo[b] = (uint8_t)(u >> 16), f8_hi[b] = (uint8_t)(u >> 24);
    }
    __atomic_store_n(&f8_bf16_ready, 1, __ATOMIC_RELEASE);
}

typedef struct {
    __m512i lo0, lo1, hi0, hi1;
} F8Tables;

static inline __attribute__((always_inline)) F8Tables f8_tables(void) {
    return (F8Tables){_mm512_load_si512(f8_lo), _mm512_load_si512(f8_lo + 64), _mm512_load_si512(f8_hi),
                      _mm512_load_si512(f8_hi + 64)};
}

/* One pair-row (64 bytes) as two vectors of bf16 (k, k + 1) pairs, features 0-15 and 16-31.
 * vpunpcklbw interleaves bytes 0-7 of each 16-byte lane, vpunpckhbw bytes 8-15: the packing put
 * 16-bit element 8L + i of the first vector at byte 16L + i, of the second at 16L + 8 + i. */
static inline __attribute__((always_inline)) void widen_pairs(const uint8_t *p, const F8Tables *t, __m512bh *w0,
                                                              __m512bh *w1) {
    const __m512i b = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
    /* hi | (b & 0x80): the sign */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, b, t->hi1), b,
                                                 _mm512_set1_epi8((char)0x80), 0xF8);
    *w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

/* H rows of x2 (bf16 pairs, ldx2 per row) against one panel: the dot sums of the top of the file,
 * gp pairs per group, G groups. Each tile widens the panel's bytes again: widening a panel once
 * into scratch for all its tiles measured no clear gain on Zen 4 at K = 768 (the lookups overlap
 * the vdpbf16ps) and a quarter slower at K = 2048, where the bf16 panel (K * NR * 2 bytes)
 * outgrows L1. */
static inline __attribute__((always_inline)) void f8_tile_dot(const uint32_t *restrict x2, int64_t ldx2,
                                                              const uint8_t *restrict panel,
                                                              const float *restrict scale,
                                                              const float *restrict bias, float *restrict y,
                                                              int64_t ldy, int64_t ncols, int64_t G, int64_t gp,
                                                              const int H) {
    const F8Tables t = f8_tables();
    float tot[MR][NR];
    for (int r = 0; r < H; r++) memset(tot[r], 0, sizeof tot[r]);
    for (int64_t g = 0; g < G; g++) {
        __m512 acc[MR][2];
        for (int r = 0; r < H; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t k2 = g * gp; k2 < (g + 1) * gp; k2++) {
            __m512bh w0, w1;
            widen_pairs(panel + k2 * PAIR_ROW, &t, &w0, &w1);
            for (int r = 0; r < H; r++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x2[r * ldx2 + k2]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
        }
        const float *s = scale + g * NR;
        const vf s0 = vload(s), s1 = vload(s + VL);
        for (int r = 0; r < H; r++) {
            vstore(tot[r], vfma(acc[r][0], s0, vload(tot[r])));
            vstore(tot[r] + VL, vfma(acc[r][1], s1, vload(tot[r] + VL)));
        }
    }
    for (int r = 0; r < H; r++) {
        float *yr = y + r * ldy;
        if (bias == NULL && ncols == NR) { /* a memcpy of a runtime size is a libc call per row */
            vstore(yr, vload(tot[r]));
            vstore(yr + VL, vload(tot[r] + VL));
        } else if (bias == NULL) {
            memcpy(yr, tot[r], sizeof(float) * (size_t)ncols);
        } else {
            for (int64_t c = 0; c < ncols; c++) yr[c] = tot[r][c] + bias[c];
        }
    }
}

#define SCRATCH_OWNER "gemm_fp8"
#include "thread_scratch.h"

static _Thread_local Scratch rounded;

/* f8_range over the dot layout: x2 holds the rounded rows, G * gp pairs each. */
static void f8_range_dot(const uint32_t *x2, const uint8_t *packed, const float *scale, const float *bias, float *y,
                         int64_t ldy, int64_t M, int64_t N, int64_t G, int64_t gp, int64_t p0, int64_t p1) {
    const int64_t K2 = G * gp;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = min64(M - m0, MB);
        const int64_t tiles = (rows + MR - 1) / MR, base = rows / tiles, taller = rows % tiles;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * NR, ncols = min64(N - n0, NR);
            const uint8_t *panel = packed + p * K2 * PAIR_ROW;
            const float *s = scale + p * G * NR, *b = bias == NULL ? NULL : bias + n0;
            for (int64_t t = 0, m = m0; t < tiles; m += base + (t < taller), t++) {
                const int64_t h = base + (t < taller);
                const uint32_t *xm = x2 + m * K2;
                float *ym = y + m * ldy + n0;
#define F8_DOT_TILE(H) f8_tile_dot(xm, K2, panel, s, b, ym, ldy, ncols, G, gp, H)
                switch (h) {
                    case 6: F8_DOT_TILE(6); break;
                    case 5: F8_DOT_TILE(5); break;
                    case 4: F8_DOT_TILE(4); break;
                    case 3: F8_DOT_TILE(3); break;
                    case 2: F8_DOT_TILE(2); break;
                    default: F8_DOT_TILE(1); break;
                }
#undef F8_DOT_TILE
            }
        }
    }
}

#include "bf16_round.h"

/* x's rows [m0, m1) as bf16 pairs, group by group (gp pairs each, k even in the low half), a group of
 * odd length ending in a pair padded with 0. */
static void round_rows(const float *x, int64_t ldx, uint32_t *x2, int64_t G, int64_t group, int64_t gp, int64_t m0,
                       int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t g = 0; g < G; g++) {
            const float *src = x + m * ldx + g * group;
            uint32_t *dst = x2 + (m * G + g) * gp;
            round_pairs(src, dst, group);
        }
    }
}
#endif

/* packed: the build's layout (top of the file) of e4m3 bytes; scale: [ceil(N / NR), K / group, NR] float32,
 * 256 times the checkpoint's (finite padding); group divides K. */
void gemm_fp8(const float *x, int64_t ldx, const uint8_t *packed, const float *scale, const float *bias, float *y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group, int num_threads) {
#if F8_PATH == 0
    if (!__atomic_load_n(&f8_table_ready, __ATOMIC_ACQUIRE)) f8_table_init(); /* idempotent: same values */
#endif
#if F8_DOT
    if (!__atomic_load_n(&f8_bf16_ready, __ATOMIC_ACQUIRE)) f8_bf16_init(); /* idempotent: same values */
    const int64_t G = K / group, gp = (group + 1) / 2;
    /* The calling thread's buffer; the team fills it (each thread its share of rows), then reads it. */
    uint32_t *x2 = scratch_for(&rounded, sizeof(uint32_t) * (size_t)(M * G * gp), "rounded activations");
#endif
    const int64_t panels = (N + NR - 1) / NR;
    /* Threads over whole panels; over rows where there are fewer panels than threads. */
    const int64_t units = panels >= num_threads ? panels : (M > panels ? M : panels);
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t lo, hi;
        int nth = 1;
#ifdef _OPENMP
        nth = omp_get_num_threads();
#endif
#if F8_DOT
        thread_share(M, &lo, &hi);
        round_rows(x, ldx, x2, G, group, gp, lo, hi);
#pragma omp barrier
        if (panels >= nth) {
            thread_share(panels, &lo, &hi);
            f8_range_dot(x2, packed, scale, bias, y, ldy, M, N, G, gp, lo, hi);
        } else {
            thread_share(M, &lo, &hi);
            f8_range_dot(x2 + lo * G * gp, packed, scale, bias, y + lo * ldy, ldy, hi - lo, N, G, gp, 0, panels);
        }
#else
        if (panels >= nth) {
            thread_share(panels, &lo, &hi);
            f8_range(x, ldx, packed, scale, bias, y, ldy, M, N, K, group, lo, hi);
        } else {
            thread_share(M, &lo, &hi);
            f8_range(x + lo * ldx, ldx, packed, scale, bias, y + lo * ldy, ldy, hi - lo, N, K, group, 0, panels);
        }
#endif
    }
}
