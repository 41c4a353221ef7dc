/* Float32 y = x @ W^T (+ bias) for the CPU torch backend's linear layers.
 *
 * Decode batches have few rows (1-128) and many output features: the work is
 * one pass over the weight, and each weight element should be loaded once per
 * MR rows and reused from registers. W is packed once at load time into
 * panels of NR output features, each panel stored k-major ([K][NR]), so the
 * inner loop reads NR contiguous floats per k and broadcasts one x value per
 * row: MR x NR accumulators stay in registers for the whole K loop, the
 * classic register-blocked GEMM micro-kernel.
 *
 * The ISA is the compiler's: GCC vector types, compiled with -march=native,
 * become 8-wide AVX2 or 16-wide AVX-512 code (FMA where present); nothing is
 * hard-coded. NR is two vectors, MR 6 rows: 12 accumulators + 2 weight
 * vectors + 1 broadcast fit AVX2's 16 registers.
 *
 * Each output element is a single sum over k = 0..K-1 in order (one fused
 * multiply-add per k), as in a plain dot product; threads split the panels,
 * never K, so the result does not depend on the thread count or on how many
 * rows share the batch.
 *
 * At 3-128 rows, a panel (48 KiB at K = 768, AVX2) read from memory by the
 * first row tile alone, the others reusing it from L2, would leave that tile
 * waiting on memory with none of the panel's other work to overlap. So every
 * tile of a panel prefetches its share of the next panel as it goes, which
 * spreads the stream over all of the panel's arithmetic. And M rows are cut
 * into ceil(M / MR) tiles of near-equal height (16 = 6 + 5 + 5, 13 = 5 + 4 +
 * 4, not 6 + 6 + 1): a tile of 1-3 rows has too few accumulators to cover the
 * FMA latency and runs at a fraction of the peak, one of 4-6 rows does not.
 *
 * x:      [M, K] float32, row stride ldx
 * packed: [ceil(N / NR), K, NR] float32 (tail panel zero-padded)
 * bias:   [N] or NULL
 * y:      [M, N] float32, row stride ldy
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define NR (2 * VL)
#define MR 6          /* the switch in panel_rows names every height 1..MR */
#define LINE 16       /* floats per 64-byte cache line */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */

int64_t gemm_nr(void) { return NR; }

/* One MR' x NR tile (MR' = mr <= MR, a literal at every call site so that the
 * row loops unroll and the accumulators live in registers). Every `every`
 * k steps it prefetches one k-row (NR floats) at *pf, then advances *pf. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *panel, int64_t K, const float *bias, float *y, int64_t ldy,
    int64_t ncols, const int mr, const float **pf, int64_t every) {
    vf acc0[MR], acc1[MR];
    vf b0 = {0}, b1 = {0};
    if (bias != NULL) {
        float tmp[NR] = {0};
        memcpy(tmp, bias, sizeof(float) * (size_t)ncols);
        b0 = *(const vfu *)tmp;
        b1 = *(const vfu *)(tmp + VL);
    }
    const float *q = *pf;
    int64_t countdown = every;
    for (int r = 0; r < mr; r++) acc0[r] = (vf){0}, acc1[r] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        if (--countdown == 0) {
            countdown = every;
            for (int l = 0; l < NR; l += LINE) __builtin_prefetch(q + l, 0, 2);
            q += NR;
        }
        const vf w0 = *(const vf *)(panel + k * NR);
        const vf w1 = *(const vf *)(panel + k * NR + VL);
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
static void panel_rows(const float *x, int64_t ldx, const float *panel, int64_t M, int64_t K, const float *bias,
                       float *y, int64_t ldy, int64_t ncols, const float *next) {
    const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, taller = M % tiles;
    /* At 1-2 rows the loop outruns memory anyway and the hardware prefetcher
     * streams best alone (software prefetches made 1 row 13 % slower, 2 rows
     * 3 %; from 3 rows on they paid); K + 1 never comes round. */
    const int64_t every = M >= 3 ? tiles : K + 1;
    const float *pf = next;
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
static void panel_range(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    /* Panels inner: each panel is read from memory once per block of rows and
     * stays in L2 while the block's rows pass it. Blocks of MB rows keep the
     * rows in L3 for a prefill chunk of thousands of rows, whose x would
     * otherwise be re-read from memory for every panel. */
    const int64_t MB = 192;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0 < MB ? M - m0 : MB;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            /* The last panel of a block prefetches the block's first (the next
             * block starts there), or itself when there is no next block. */
            const int64_t pn = p + 1 < p1 ? p + 1 : (m0 + MB < M ? p0 : p);
            panel_rows(x + m0 * ldx, ldx, packed + p * K * NR, rows, K, bias == NULL ? NULL : bias + n0,
                       y + m0 * ldy + n0, ldy, ncols, packed + pn * K * NR);
        }
    }
}

/* Panels [p0, p1) of the product on the calling thread alone: for a caller that
 * splits the work of many GEMMs over its own threads (moe_f32.c's experts). */
void gemm_f32_panels(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    panel_range(x, ldx, packed, bias, y, ldy, M, N, K, p0, p1);
}

void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy, int64_t M,
              int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* A thread gets a contiguous run of panels, so its weight reads are one
     * sequential stream the prefetches can run ahead in; no more threads than
     * panels. */
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
