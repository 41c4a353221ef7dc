/* Float32 y = x @ W^T (+ bias) over bfloat16 weights, for the CPU linear layers.
 *
 * Decode on a CPU is bound by the weight bytes read per step; checkpoints ship
 * in bfloat16, and keeping W in bf16 halves those bytes against gemm_f32.c.
 * The arithmetic stays float32: a bf16 value is the top 16 bits of a float32,
 * so widening it is a shift (or a mask) in registers, exact, and each output
 * is the same one in-order float32 fused sum over k as gemm_f32.c computes on
 * the bf16-rounded weight, bit for bit. (AVX512_BF16's dot products would read
 * the weights as fast but round x to bf16 and sum pairs of k, another result.)
 *
 * Everything else is gemm_f32.c's, read that first: W packed once into panels
 * of NR output features, k-major, so the MR x NR accumulators of a row tile
 * stay in registers for the whole K loop; near-equal row tiles; each tile
 * prefetching its share of the next panel; threads splitting panels, never K,
 * so the result does not depend on the thread count or the batch's other rows.
 *
 * Within a panel's k-row the two vectors' weights are interleaved: 16-bit
 * element 2i holds feature i (of the first vector) and 2i + 1 feature VL + i
 * (of the second). One VL x 32-bit load then carries both vectors, and on a
 * little-endian CPU lane i is (feature VL + i) << 16 | feature i, so the first
 * vector is lane << 16 and the second lane & 0xffff0000: one load and two
 * one-cycle bit operations per k, no zero-extending shuffles.
 *
 * The ISA is the compiler's, as in gemm_f32.c: GCC vector types, compiled with
 * -march=native (or x86-64-v3 in the tests), become 8-wide AVX2 or 16-wide
 * AVX-512 code with FMA; nothing is hard-coded.
 *
 * x:      [M, K] float32, row stride ldx
 * packed: [ceil(N / NR), K, NR] bf16 bits (uint16), interleaved as above,
 *         tail panel zero-padded
 * bias:   [N] float32 or NULL
 * y:      [M, N] float32, row stride ldy
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
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

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

int64_t gemm_bf16_nr(void) { return NR; }

/* One MR' x NR tile (MR' = mr <= MR, a literal at every call site so that the
 * row loops unroll and the accumulators live in registers). Every `every`
 * k steps it prefetches one k-row (NR bf16) at *pf, then advances *pf. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const uint16_t *panel, int64_t K, const float *bias, float *y, int64_t ldy,
    int64_t ncols, const int mr, const uint16_t **pf, int64_t every) {
    vf acc0[MR], acc1[MR];
    vf b0 = {0}, b1 = {0};
    if (bias != NULL) {
        float tmp[NR] = {0};
        memcpy(tmp, bias, sizeof(float) * (size_t)ncols);
        b0 = *(const vfu *)tmp;
        b1 = *(const vfu *)(tmp + VL);
    }
    const uint16_t *q = *pf;
    int64_t countdown = every;
    for (int r = 0; r < mr; r++) acc0[r] = (vf){0}, acc1[r] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        if (--countdown == 0) {
            countdown = every;
            /* At VL = 8 a k-row is half a line: the second prefetch of a line
             * is a cheap hit, and keeps the schedule gemm_f32.c measured. */
            for (int l = 0; l < NR; l += LINE) __builtin_prefetch(q + l, 0, 2);
            q += NR;
        }
        const vu pair = *(const vu *)(panel + k * NR);
        const vf w0 = (vf)(pair << 16);           /* a vector cast reinterprets the bits */
        const vf w1 = (vf)(pair & 0xffff0000u);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * ldx + k];
            acc0[r] += a * w0;
            acc1[r] += a * w1;
        }
    }
    *pf = q;
    /* The bias is added after the sum, as torch's addmm does (beta * bias + x @ W^T). */
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

/* All M rows against one panel, in ceil(M / MR) tiles of near-equal height;
 * meanwhile the tiles prefetch `next` (the panel this thread computes next),
 * each tile about K / tiles of its k-rows, one every `tiles` k steps. */
static void panel_rows(const float *x, int64_t ldx, const uint16_t *panel, int64_t M, int64_t K, const float *bias,
                       float *y, int64_t ldy, int64_t ncols, const uint16_t *next) {
    const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, taller = M % tiles;
    /* At 1-2 rows the hardware prefetcher streams best alone (gemm_f32.c's
     * measurement); K + 1 never comes round. */
    const int64_t every = M >= 3 ? tiles : K + 1;
    const uint16_t *pf = next;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = base + (t < taller);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (h) {
            case 6: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 6, &pf, every); break;
            case 5: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 5, &pf, every); break;
            case 4: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 4, &pf, every); break;
            case 3: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 3, &pf, every); break;
            case 2: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 2, &pf, every); break;
            default: tile(xm, ldx, panel, K, bias, ym, ldy, ncols, 1, &pf, every); break;
        }
        m += h;
    }
}

/* Panels [p0, p1) for rows [0, M), in blocks of MB rows. */
static void panel_range(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    /* Panels inner, so a panel is read from memory once per block of rows;
     * blocks of MB rows keep a long prefill's rows in L3 (see gemm_f32.c). */
    const int64_t MB = 192;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0 < MB ? M - m0 : MB;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            const int64_t pn = p + 1 < p1 ? p + 1 : (m0 + MB < M ? p0 : p);
            panel_rows(x + m0 * ldx, ldx, packed + p * K * NR, rows, K, bias == NULL ? NULL : bias + n0,
                       y + m0 * ldy + n0, ldy, ncols, packed + pn * K * NR);
        }
    }
}

void gemm_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
               int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* A contiguous run of panels per thread: one sequential weight stream. */
    const int threads = panels < num_threads ? (int)panels : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        panel_range(x, ldx, packed, bias, y, ldy, M, N, K, panels * tid / nth, panels * (tid + 1) / nth);
    }
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
