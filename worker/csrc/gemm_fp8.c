/* Float32 y = x @ W^T (+ bias) over FP8 (e4m3fn) weights, for the CPU linear layers of
 * FP8 checkpoints: the weights stay one byte each and are widened to float32 in registers
 * as the K loop meets them; x stays float32 (activation scales of the checkpoint are not
 * applied: the CPU computes with float activations, as transformers' dequantized reference
 * does). Read gemm_f32.c and gemm_quant.c first: the blocking is theirs (W packed once at
 * load into panels of NR output features, k-major, so an MR x NR tile of accumulators stays
 * in registers for the whole K loop; near-equal row tiles; threads split whole panels, or
 * rows, never K, so no output depends on the thread count or on the batch's other rows).
 *
 * Widening: an e4m3 byte b (sign, 4 exponent bits of bias 7, 3 mantissa bits) is exactly the
 * half-precision number with bits ((b & 0x80) << 8) | ((b & 0x7f) << 7) times 2^8, normals and
 * subnormals alike (half's exponent field is one bit wider, bias 15: 2^(15 - 7) apart, and a
 * subnormal e4m3 m * 2^-9 is the subnormal half m * 2^-17). In registers: sign-extend the
 * bytes to 16 bits (vpmovsxbw), shift left by 7, keep the sign and the seven value bits
 * (and 0xBF80: the sign extension's ones above them go), then vcvtph2ps to float32, exact
 * (every half is a normal float32). No float32 subnormals appear, so no microcode assists.
 * The 2^8 is folded into the scales at pack time (exact: a power of two). The bytes 0x7f and
 * 0xff (NaN in e4m3fn) would widen to +-480: the Python side refuses weights holding them.
 *
 * The sums, per output (row m, feature n), with w' = the widened value (w * 2^-8) and
 * s' = 256 * the float32 scale of (n, group g):
 *     part_g = sum over k of group g, in order, of x[m, k] * w'[n, k]   (fmaf each, from 0)
 *     tot    = fmaf(part_g, s'_g, tot) over g in order, from 0;  y = tot + bias[n]
 * One group (per-channel or per-tensor scales) is group = K. Every product is exact before
 * its one rounding, each step is one fused multiply-add on every path (vfmadd on AVX-512 and
 * AVX2, libm's fmaf in the portable C), so every build gives the same bits.
 *
 * Paths (compile time, the build's -march: worker/native_build.py builds with -march=native,
 * NORIA_CPU_MARCH builds another host's): AVX-512F (16 floats per vector, 6-row tiles), AVX2
 * with F16C and FMA (8 floats, 4-row tiles), portable C (a 256-entry table). Panels:
 * [ceil(N / NR), K, NR] bytes (NR = 2 vectors), the tail panel padded with zero bytes (0.0);
 * scales [ceil(N / NR), K / group, NR] float32.
 *
 * The native decoder driver (decoder_f32.c) reaches gemm_fp8 through gemm_quant.c's descriptor
 * dispatcher: a packed weight's GemmQuantDesc of kind fp8 holds this function's address.
 *
 * x:  [M, K] float32, row stride ldx;  y: [M, N] float32, row stride ldy;  bias: [N] or NULL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
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
int64_t gemm_fp8_nr(void) { return NR; }
/* What a packed weight's descriptor records of the build that packed it (gemm_quant.c's GemmQuantDesc.layout). */
int32_t gemm_fp8_layout(void) { return (int32_t)(F8_PATH << 8 | NR); }

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
        if (bias == NULL) {
            memcpy(yr, tot[r], sizeof(float) * (size_t)ncols);
        } else {
            for (int64_t c = 0; c < ncols; c++) yr[c] = tot[r][c] + bias[c];
        }
    }
}

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

/* packed: [ceil(N / NR), K, NR] e4m3 bytes; scale: [ceil(N / NR), K / group, NR] float32, 256 times the
 * checkpoint's (finite padding); group divides K. */
void gemm_fp8(const float *x, int64_t ldx, const uint8_t *packed, const float *scale, const float *bias, float *y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group, int num_threads) {
#if F8_PATH == 0
    if (!__atomic_load_n(&f8_table_ready, __ATOMIC_ACQUIRE)) f8_table_init(); /* idempotent: same values */
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
        if (panels >= nth) {
            thread_share(panels, &lo, &hi);
            f8_range(x, ldx, packed, scale, bias, y, ldy, M, N, K, group, lo, hi);
        } else {
            thread_share(M, &lo, &hi);
            f8_range(x + lo * ldx, ldx, packed, scale, bias, y + lo * ldy, ldy, hi - lo, N, K, group, 0, panels);
        }
    }
}
