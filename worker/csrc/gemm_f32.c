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
 * x:      [M, K] float32, row stride ldx
 * packed: [ceil(N / NR), K, NR] float32 (tail panel zero-padded)
 * bias:   [N] or NULL
 * y:      [M, N] float32, row stride ldy
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define NR (2 * VL)
#define MR 6

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */

int64_t gemm_nr(void) { return NR; }

/* One MR' x NR tile (MR' = mr <= MR, a literal at every call site so that the
 * row loops unroll and the accumulators live in registers). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *panel, int64_t K, const float *bias, float *y, int64_t ldy,
    int64_t ncols, const int mr) {
    vf acc0[MR], acc1[MR];
    vf b0 = {0}, b1 = {0};
    if (bias != NULL) {
        float tmp[NR] = {0};
        memcpy(tmp, bias, sizeof(float) * (size_t)ncols);
        b0 = *(const vfu *)tmp;
        b1 = *(const vfu *)(tmp + VL);
    }
    for (int r = 0; r < mr; r++) acc0[r] = (vf){0}, acc1[r] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = *(const vf *)(panel + k * NR);
        const vf w1 = *(const vf *)(panel + k * NR + VL);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * ldx + k];
            acc0[r] += a * w0;
            acc1[r] += a * w1;
        }
    }
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

static void panel_rows(const float *x, int64_t ldx, const float *panel, int64_t M, int64_t K, const float *bias,
                       float *y, int64_t ldy, int64_t ncols) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, MR);
    switch (M - m) {
        case 5: tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 5); break;
        case 4: tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 4); break;
        case 3: tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 3); break;
        case 2: tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 2); break;
        case 1: tile(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 1); break;
        default: break;
    }
}

void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy, int64_t M,
              int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* Panels inner: each panel (K x NR floats, 48 KiB at K = 768) is read from
     * memory once per block of rows and stays in L2 while the block's rows pass
     * it. Blocks of MB rows keep the rows in L3 for a prefill chunk of
     * thousands of rows, whose x would otherwise be re-read from memory for
     * every panel. */
    const int64_t MB = 192;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0 < MB ? M - m0 : MB;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            panel_rows(x + m0 * ldx, ldx, packed + p * K * NR, rows, K, bias == NULL ? NULL : bias + n0,
                       y + m0 * ldy + n0, ldy, ncols);
        }
    }
}
