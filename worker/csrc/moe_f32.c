/* A mixture-of-experts block's routed experts in one call, for the CPU torch backend.
 *
 * Given each token's top-k expert ids and routing weights, it does what
 * SparseMoeBlock.experts does in Python: the (token, choice) pairs sorted by
 * expert (stable: tokens in order within an expert), the rows gathered, per
 * active expert one gate/up GEMM, SiLU-and-mul and one down GEMM, and each
 * token's k weighted rows added in expert order onto zero. The Python path makes
 * ~5 calls per active expert, each a fork/join of the GEMM's threads over one
 * expert's panels; here one parallel region runs every phase, so two cores stay
 * busy also when one expert holds all the rows or each holds one.
 *
 * The arithmetic is the Python path's, bit for bit: the GEMMs are gemm_f32.c's
 * panel loop and the activation fused_f32.c's silu_mul, reached through
 * function pointers (each library keeps its own flags: in-order FMA sums there,
 * no contraction here), and every output element of a GEMM is one in-order sum
 * over K whichever (expert, row tile, column tile) task computes it. This file
 * is built with -ffp-contract=off, so `acc + w * y` rounds the product first,
 * as torch's `done * w` then index_add_ do.
 *
 * Work split: a task is (expert, row tile of at most ROWS rows, run of panels);
 * threads take tasks dynamically, in expert order, so a thread's weight reads
 * are a few long sequential runs. The tasks' count scales with the threads.
 *
 * x [T, H]; ids [T, k] int64 in [0, E); weights [T, k] float32;
 * gate_up[e]: expert e's [2I, H] weight packed as gemm_f32.c packs it,
 * down[e]: its [H, I]; out [T, H] (overwritten); scratch: T * k * (H + 3I)
 * floats, the caller's, kept across calls (a fresh mapping of a prefill's
 * tens of MB per call costs its page faults, ~10 % of the call).
 * Returns 0, -1 when scratch memory could not be allocated (out untouched),
 * -2 on an expert id out of range or k outside 1..64.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef void (*panels_fn)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
                          int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1);
typedef void (*silu_fn)(const float *gate_up, int64_t ld, float *out, int64_t T, int64_t n, int num_threads);

#define ROWS 192 /* gemm_f32.c's row block: a task's rows stay in cache while its panels pass */

typedef struct {
    int64_t expert, row0, rows, p0, p1;
} Task;

/* Tasks over every active expert for a GEMM with `panels` panels: row tiles of at
 * most ROWS rows, each cut into runs of panels so that there are about 16 runs per
 * thread over the whole call (at least one panel each). Returns the count. */
static int64_t plan(Task *tasks, const int64_t *counts, const int64_t *offsets, int64_t E, int64_t panels,
                    int threads) {
    int64_t tiles = 0;
    for (int64_t e = 0; e < E; e++) tiles += (counts[e] + ROWS - 1) / ROWS;
    if (tiles == 0) return 0;
    int64_t want = 16 * (int64_t)threads, cuts = (want + tiles - 1) / tiles;
    if (threads == 1) cuts = 1;
    if (cuts > panels) cuts = panels;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < counts[e]; r += ROWS)
            for (int64_t c = 0; c < cuts; c++) {
                const int64_t rows = counts[e] - r < ROWS ? counts[e] - r : ROWS;
                tasks[n++] = (Task){e, offsets[e] + r, rows, panels * c / cuts, panels * (c + 1) / cuts};
            }
    return n;
}

int moe_experts(panels_fn gemm, silu_fn silu, int64_t nr, const float *x, int64_t T, int64_t H, int64_t I,
                int64_t E, int64_t k, const int64_t *ids, const float *weights, const float *const *gate_up,
                const float *const *down, float *out, float *scratch, int num_threads) {
    const int64_t R = T * k, gu_n = 2 * I;
    if (k < 1 || k > 64) return -2;
    for (int64_t i = 0; i < R; i++)
        if (ids[i] < 0 || ids[i] >= E) return -2;
    if (T == 0) return 0;
    const int64_t gu_panels = (gu_n + nr - 1) / nr, down_panels = (H + nr - 1) / nr;
    const int threads = num_threads < 1 ? 1 : num_threads;
    /* plan() makes at most tiles + 16 * threads tasks, tiles <= R / ROWS + E */
    const int64_t max_tasks = 2 * (R + E + 16 * (int64_t)threads) + 2;
    /* rows [R, H] (the gathered inputs, then the down GEMM's outputs), gate/up [R, 2I], act [R, I] */
    float *rows = scratch;
    int64_t *counts = calloc((size_t)(3 * E + 2 * R), sizeof(int64_t));
    Task *tasks = malloc(sizeof(Task) * (size_t)max_tasks);
    if (counts == NULL || tasks == NULL) {
        free(counts), free(tasks);
        return -1;
    }
    float *gu = rows + R * H, *act = gu + R * gu_n;
    int64_t *offsets = counts + E, *next = offsets + E, *token = next + E, *slot = token + R;

    /* Counting sort of the (token, choice) pairs by expert, stable in t * k + j. */
    for (int64_t i = 0; i < R; i++) counts[ids[i]]++;
    for (int64_t e = 0, at = 0; e < E; e++) offsets[e] = at, at += counts[e];
    memcpy(next, offsets, sizeof(int64_t) * (size_t)E);
    for (int64_t i = 0; i < R; i++) {
        const int64_t s = next[ids[i]]++;
        token[s] = i / k;
        slot[i] = s;
    }
    Task *gu_tasks = tasks;
    const int64_t n_gu = plan(gu_tasks, counts, offsets, E, gu_panels, threads);
    Task *down_tasks = tasks + n_gu;
    const int64_t n_down = plan(down_tasks, counts, offsets, E, down_panels, threads);

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < R; s++) memcpy(rows + s * H, x + token[s] * H, sizeof(float) * (size_t)H);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_gu; i++) {
            const Task *t = &gu_tasks[i];
            gemm(rows + t->row0 * H, H, gate_up[t->expert], NULL, gu + t->row0 * gu_n, gu_n, t->rows, gu_n, H,
                 t->p0, t->p1);
        }
        /* One call per thread on its share of the rows: silu_mul's own (serial) region is entered once. */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < threads; c++) {
            const int64_t s0 = R * c / threads, s1 = R * (c + 1) / threads;
            if (s1 > s0) silu(gu + s0 * gu_n, gu_n, act + s0 * I, s1 - s0, I, 1);
        }
        /* The gathered rows are spent: the down GEMM writes its outputs over them. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_down; i++) {
            const Task *t = &down_tasks[i];
            gemm(act + t->row0 * I, I, down[t->expert], NULL, rows + t->row0 * H, H, t->rows, H, I, t->p0, t->p1);
        }
#pragma omp for schedule(static)
        for (int64_t tok = 0; tok < T; tok++) {
            /* This token's choices in expert order (the ids of one token are distinct). */
            int64_t order[64], n = 0;
            for (int64_t j = 0; j < k; j++) {
                int64_t p = n++;
                while (p > 0 && ids[tok * k + order[p - 1]] > ids[tok * k + j]) order[p] = order[p - 1], p--;
                order[p] = j;
            }
            float *o = out + tok * H;
            for (int64_t c = 0; c < H; c++) o[c] = 0.f;
            for (int64_t q = 0; q < k; q++) {
                const int64_t j = order[q];
                const float w = weights[tok * k + j], *y = rows + slot[tok * k + j] * H;
                for (int64_t c = 0; c < H; c++) o[c] = o[c] + w * y[c];
            }
        }
    }
    free(counts), free(tasks);
    return 0;
}
