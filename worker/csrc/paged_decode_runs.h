/* Rows of one sequence attended as tiles (included by paged_decode.c, after attend()).
 *
 * A prefill step on the CPU passes each prompt token as a row of its own (attention.py's
 * paged_rows), and a row re-reads its sequence's keys: per layer a prompt of n tokens costs
 * n^2 / 2 token rows, each scored by dot products summed across the lanes. Consecutive rows
 * whose lengths step by one and whose block tables agree are one sequence's queries (a "run");
 * from RUN_MIN rows on, a task takes a tile of them (queries x a KV head's query heads, at most
 * MAX_TASK_FLOATS of queries) and reads each tile of KT keys once for all of them: the keys are
 * widened into a transposed float32 tile (gathered across blocks), so that one row's KT scores are
 * D vector FMAs with no sum across lanes, RB rows at a time, and the values into float32 rows. On a
 * W1-sized prefill chunk (13 prompts of 32-256 tokens, 2,048 rows, 12 heads of 64 over 4 KV heads,
 * bf16 cache) a layer took 14.6-15.4 ms against attend()'s 17.8-18.1 on one thread, 6.5-7.7
 * against 8.2-9.7 on two: what is left past the FMAs is the per-row softmax of each tile.
 *
 * Each row's result depends on its own query and keys only, never on which rows share its task:
 * the key tiles are KT tokens from position 0, a key past the row's length is excluded from its
 * max and weighs exactly 0, and a tile wholly past it is skipped. So
 * a sequence's outputs are the same bits however its rows are cut into tasks or steps (a row
 * alone, short of a run, goes through attend(): the same values, summed in another order).
 * Used for float32, bfloat16 and float16 caches without a sliding window in reach, head sizes a
 * multiple of the vector width up to MAX_RUN_D; fp8 and the rest stay on attend(). */

#define RUN_MIN 8    /* rows of one sequence from which they are attended as tiles */
#define KT 32        /* keys per tile, across blocks: two 16-float vectors of scores a row */
#define MAX_RUN_D 256
#define RB 4        /* query rows scored together */

typedef struct {
    int64_t b0, n, kh; /* rows b0 .. b0 + n - 1 of one run, KV head kh */
} RowTile;

/* Whether rows b and b + 1 continue one sequence: b + 1 one key longer, and the blocks it reads
 * the same in both tables (row b reads a prefix of them). */
static int continues_run(const int64_t *table, int64_t max_blocks, const int64_t *lens, int64_t b,
                         int64_t block_size) {
    if (lens[b + 1] != lens[b] + 1 || lens[b] < 1) return 0;
    const int64_t nb = (lens[b + 1] + block_size - 1) / block_size;
    return nb <= max_blocks &&
           memcmp(table + b * max_blocks, table + (b + 1) * max_blocks, sizeof(int64_t) * (size_t)nb) == 0;
}

static int runs_apply(int64_t D, int64_t group, enum kv_elt elt) {
    return elt != KV_FP8 && D % VW == 0 && D <= MAX_RUN_D && MAX_TASK_FLOATS / D / group >= 2;
}

/* Marks in_run[b] for the rows of runs of RUN_MIN rows or more whose keys lie within the window
 * (window 0: none) and fills tiles (NULL: counts them); returns the number of tiles. */
static int64_t find_runs(const int64_t *table, int64_t max_blocks, const int64_t *lens, int64_t batch,
                         int64_t block_size, int64_t window, int64_t num_kv_heads, int64_t D, int64_t group,
                         char *in_run, RowTile *tiles) {
    const int64_t per = MAX_TASK_FLOATS / D / group; /* queries per tile */
    int64_t count = 0;
    for (int64_t b0 = 0; b0 < batch;) {
        int64_t b1 = b0 + 1;
        while (b1 < batch && continues_run(table, max_blocks, lens, b1 - 1, block_size)) b1++;
        const int in_window = window <= 0 || lens[b1 - 1] <= window;
        const int run = b1 - b0 >= RUN_MIN && in_window;
        for (int64_t b = b0; b < b1; b++) in_run[b] = (char)run;
        if (run) {
            const int64_t pieces = (b1 - b0 + per - 1) / per;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                for (int64_t i = 0; i < pieces; i++, count++)
                    if (tiles) {
                        /* near-equal pieces: no short last tile */
                        const int64_t lo = b0 + (b1 - b0) * i / pieces, hi = b0 + (b1 - b0) * (i + 1) / pieces;
                        tiles[count] = (RowTile){lo, hi - lo, kh};
                    }
        }
        b0 = b1;
    }
    return count;
}

/* One tile of rows: their queries against every key of the longest, each row up to its own length. */
static inline __attribute__((always_inline)) void attend_rows(
    const RowTile *rt, const float *q, const char *k_cache, const char *v_cache, const int64_t *table,
    const int64_t *lens, int64_t num_heads, int64_t group, const int64_t D, int64_t block_size, int64_t ts,
    float scale, float cap, float *out, const enum kv_elt elt) {
    const int64_t R = rt->n * group, h0 = rt->kh * group, last = lens[rt->b0 + rt->n - 1];
    float Q[MAX_TASK_FLOATS], O[MAX_TASK_FLOATS], Kt[MAX_RUN_D * KT], Vt[KT * MAX_RUN_D];
    float m[MAX_TASK_FLOATS / VW], l[MAX_TASK_FLOATS / VW];
    for (int64_t i = 0; i < R; i++) {
        const float *src = q + ((rt->b0 + i / group) * num_heads + h0 + i % group) * D;
        for (int64_t d = 0; d < D; d++) Q[i * D + d] = src[d] * scale;
        m[i] = -INFINITY, l[i] = 0.f;
    }
    memset(O, 0, sizeof(float) * (size_t)(R * D));
    const char *kh = kv_at(k_cache, rt->kh * D, elt), *vh = kv_at(v_cache, rt->kh * D, elt);
    for (int64_t pos = 0; pos < last; pos += KT) {
        const int64_t n = last - pos < KT ? last - pos : KT;
        for (int64_t t = 0; t < KT; t++) {
            if (t >= n) {
                for (int64_t d = 0; d < D; d++) Kt[d * KT + t] = 0.f;
                continue;
            }
            const int64_t at = table[(pos + t) / block_size] * block_size * ts + (pos + t) % block_size * ts;
            const char *kt = kv_at(kh, at, elt), *vt = kv_at(vh, at, elt);
            for (int64_t d = 0; d < D; d++) Kt[d * KT + t] = kv_load(kt, d, elt);
            for (int64_t d = 0; d < D; d += VW) *(vfu *)(Vt + t * D + d) = kv_vec(vt, d, elt);
        }
        for (int64_t i0 = 0; i0 < R; i0 += RB) {
            /* RB rows' scores at once: one load of each key vector for RB independent chains (one
             * row's D products chained on the FMA latency). Every row is summed the same way in
             * every block; a block's rows past R score a copy of the last and are dropped. */
            vf sv[RB][KT / VW] = {{0}};
            const float *qr[RB];
            for (int b = 0; b < RB; b++) qr[b] = Q + (i0 + b < R ? i0 + b : R - 1) * D;
            for (int64_t d = 0; d < D; d++)
                for (int v = 0; v < KT / VW; v++) {
                    const vf kd = *(const vfu *)(Kt + d * KT + v * VW);
                    for (int b = 0; b < RB; b++) sv[b][v] += qr[b][d] * kd;
                }
            for (int b = 0; b < RB && i0 + b < R; b++) {
                const int64_t i = i0 + b, len = lens[rt->b0 + i / group];
                if (pos >= len) continue;
                const int64_t nv = len - pos < n ? len - pos : n;
                float s[KT], p[KT];
                memcpy(s, sv[b], sizeof s);
                if (cap > 0.f)
#pragma omp simd
                    for (int t = 0; t < KT; t++) s[t] = soft_cap(s[t], cap);
                float mx = m[i];
#pragma omp simd reduction(max : mx)
                for (int t = 0; t < KT; t++) mx = t < nv && s[t] > mx ? s[t] : mx;
                const float corr = exp_neg(m[i] - mx);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < KT; t++) {
                    p[t] = t < nv ? exp_neg(s[t] - mx) : 0.f;
                    sum += p[t];
                }
                l[i] = l[i] * corr + sum;
                m[i] = mx;
                float *o = O + i * D;
                for (int64_t c = 0; c < D; c += VCHUNK * VW) {
                    const int64_t nvec = (D - c) / VW < VCHUNK ? (D - c) / VW : VCHUNK;
                    vf r[VCHUNK];
                    for (int64_t j = 0; j < nvec; j++) r[j] = *(const vfu *)(o + c + j * VW) * corr;
                    for (int64_t t = 0; t < nv; t++)
                        for (int64_t j = 0; j < nvec; j++) r[j] += p[t] * *(const vfu *)(Vt + t * D + c + j * VW);
                    for (int64_t j = 0; j < nvec; j++) *(vfu *)(o + c + j * VW) = r[j];
                }
            }
        }
    }
    for (int64_t i = 0; i < R; i++) {
        float *dst = out + ((rt->b0 + i / group) * num_heads + h0 + i % group) * D;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int64_t d = 0; d < D; d++) dst[d] = O[i * D + d] * inv;
    }
}

#define ATTEND_ROWS_PARAMS                                                                                    \
    const RowTile *rt, const float *q, const char *k_cache, const char *v_cache, const int64_t *block_table, \
        int64_t max_blocks, const int64_t *lens, int64_t num_heads, int64_t group, int64_t D,                 \
        int64_t block_size, int64_t ts, float scale, float cap, float *out
#define ATTEND_ROWS_AT(DIM, ELT)                                                                              \
    attend_rows(rt, q, k_cache, v_cache, block_table + (rt->b0 + rt->n - 1) * max_blocks, lens, num_heads,   \
                group, DIM, block_size, ts, scale, cap, out, ELT)

static inline __attribute__((always_inline)) void attend_rows_as(ATTEND_ROWS_PARAMS, const enum kv_elt elt) {
    if (D == 64)
        ATTEND_ROWS_AT(64, elt);
    else if (D == 128)
        ATTEND_ROWS_AT(128, elt);
    else
        ATTEND_ROWS_AT(D, elt);
}

#define ATTEND_ROWS_ARGS \
    rt, q, k_cache, v_cache, block_table, max_blocks, lens, num_heads, group, D, block_size, ts, scale, cap, out
/* One out-of-line copy per element type: each specialises its inner loops on its own. */
#define ATTEND_ROWS_FOR(NAME, ELT) \
    static __attribute__((noinline)) void NAME(ATTEND_ROWS_PARAMS) { attend_rows_as(ATTEND_ROWS_ARGS, ELT); }
ATTEND_ROWS_FOR(attend_rows_f16, KV_F16)
ATTEND_ROWS_FOR(attend_rows_bf16, KV_BF16)
ATTEND_ROWS_FOR(attend_rows_f32, KV_F32)

static void run_rows(ATTEND_ROWS_PARAMS, const enum kv_elt elt) {
    void (*const attend)(ATTEND_ROWS_PARAMS) =
        elt == KV_F16 ? attend_rows_f16 : elt == KV_BF16 ? attend_rows_bf16 : attend_rows_f32;
    attend(ATTEND_ROWS_ARGS);
}

/* The number of row tiles a call on these rows attends (0 where they all go through attend()), for
 * the tests. elt: enum kv_elt's order (0 float32, 1 bfloat16, 2 float16, 3 fp8). */
int64_t paged_decode_row_tiles(const int64_t *block_table, const int64_t *seq_lens, int64_t batch,
                               int64_t max_blocks, int64_t block_size, int64_t window, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int elt) {
    const int64_t group = num_heads / num_kv_heads;
    if (batch < RUN_MIN || !runs_apply(head_dim, group, (enum kv_elt)elt)) return 0;
    char *in_run = calloc((size_t)batch, 1);
    if (in_run == NULL) return -1;
    const int64_t n = find_runs(block_table, max_blocks, seq_lens, batch, block_size, window, num_kv_heads,
                                head_dim, group, in_run, NULL);
    free(in_run);
    return n;
}
