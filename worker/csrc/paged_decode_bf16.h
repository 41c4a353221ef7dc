/* bfloat16 caches read in pairs, scored a tile at a time (included by paged_decode.c, after
 * kv_vec).
 *
 * Widening a bf16 vector in place (vpmovzxwd, then a shift) costs two instructions for every VW
 * elements, and GCC splits the zero-extension of a 16-wide vector in two more: in W1's decode
 * the widening bound the loops over V and over the scores. Read as 32-bit words instead, 2 VW
 * elements at a time, a bf16 pair widens in one instruction each: the even element is the word
 * shifted left by 16, the odd one the word with its low half cleared. Both loops then work on
 * "split" rows, each chunk of 2 VW elements as its VW even elements, then its VW odd ones: the
 * queries are split once per task, the V accumulators live split and are put back in order once
 * at the end of attend(). Used where D is a multiple of 2 VW.
 *
 * A score summed by a horizontal sum of its own costs 2 log2(VW) dependent shuffles and adds;
 * bf16_tile_scores computes VW tokens' vectors of products for one head and sums them together
 * (tree_sum): VW - 1 folds of two shuffles and an add for VW scores. On W1's shapes (24
 * sequences of 200-500 tokens, 12 heads of 64 over 4 KV heads, bf16 K/V not in cache) the two
 * took a call from ~67 to ~56 ns per token row on two threads; the tree alone is 2-5 % of that,
 * and did not pay for float32 or float16 caches, which keep dot_qk.
 *
 * Only the order in which a score's products are added changes; every product is the same. */

/* VW vectors summed lane by lane into one: lane j the sum of v[j]. The vectors are folded in
 * pairs, halving the lanes each level; after the levels lane l holds the sum of v[bit-reversed
 * l], and one last shuffle puts them in order. */
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));
#define FOLD_LANE(l, B, hi) ((((l) / (B)) % 2 == 0) ? (l) + ((hi) ? (B) : 0) : VW + (l) - ((hi) ? 0 : (B)))
#define FOLD_LANES4(B, hi, o) FOLD_LANE(o, B, hi), FOLD_LANE(o + 1, B, hi), FOLD_LANE(o + 2, B, hi), FOLD_LANE(o + 3, B, hi)
#if VW == 16
#define FOLD_MASK(B, hi) \
    (vi){FOLD_LANES4(B, hi, 0), FOLD_LANES4(B, hi, 4), FOLD_LANES4(B, hi, 8), FOLD_LANES4(B, hi, 12)}
#define BIT_REVERSED (vi){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}
#elif VW == 8
#define FOLD_MASK(B, hi) (vi){FOLD_LANES4(B, hi, 0), FOLD_LANES4(B, hi, 4)}
#define BIT_REVERSED (vi){0, 4, 2, 6, 1, 5, 3, 7}
#else
#define FOLD_MASK(B, hi) (vi){FOLD_LANES4(B, hi, 0)}
#define BIT_REVERSED (vi){0, 2, 1, 3}
#endif
#define FOLD_LEVEL(v, n, B)                                                                                \
    for (int j = 0; j < (n) / 2; j++)                                                                     \
        v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], FOLD_MASK(B, 0)) +                               \
               __builtin_shuffle(v[2 * j], v[2 * j + 1], FOLD_MASK(B, 1));

static inline __attribute__((always_inline)) vf tree_sum(vf *v) {
#if VW == 16
    FOLD_LEVEL(v, 16, 8)
#endif
#if VW >= 8
    FOLD_LEVEL(v, 8, 4)
#endif
    FOLD_LEVEL(v, 4, 2)
    FOLD_LEVEL(v, 2, 1)
    return __builtin_shuffle(v[0], BIT_REVERSED);
}

typedef uint32_t vuu __attribute__((vector_size(VW * sizeof(uint32_t)), aligned(sizeof(uint16_t)))); /* unaligned */
#define BF16_PAIR_CHUNK (2 * VW)
#define BF16_MAX_PAIRS (128 / BF16_PAIR_CHUNK > 0 ? 128 / BF16_PAIR_CHUNK : 1) /* D up to 128 in registers */
#define BF16_HEADS 4 /* query heads of one KV head accumulated together at most */

/* A tile of fewer than VW tokens would waste the rest of bf16_tile_scores' vectors: blocks of whole VW. */
static inline int bf16_pairs(const int64_t D, const enum kv_elt elt, int64_t block_size) {
    return elt == KV_BF16 && D % BF16_PAIR_CHUNK == 0 && D / BF16_PAIR_CHUNK <= BF16_MAX_PAIRS && TILE % VW == 0 &&
           block_size % VW == 0;
}

static inline vf bf16_even(vu w) { return (vf)(w << 16); }
static inline vf bf16_odd(vu w) { return (vf)(w & 0xffff0000u); }

/* One head's D values, in place: in order -> split, and back. */
static inline void bf16_split(float *row, const int64_t D) {
    float tmp[128];
    for (int64_t c = 0; c < D; c += BF16_PAIR_CHUNK)
        for (int64_t j = 0; j < VW; j++) tmp[c + j] = row[c + 2 * j], tmp[c + VW + j] = row[c + 2 * j + 1];
    memcpy(row, tmp, sizeof(float) * (size_t)D);
}

static inline void bf16_unsplit(float *row, const int64_t D) {
    float tmp[128];
    for (int64_t c = 0; c < D; c += BF16_PAIR_CHUNK)
        for (int64_t j = 0; j < VW; j++) tmp[c + 2 * j] = row[c + j], tmp[c + 2 * j + 1] = row[c + VW + j];
    memcpy(row, tmp, sizeof(float) * (size_t)D);
}

/* Scores of the tile's n tokens (rows `ts` elements apart from krow) for every head of the task,
 * head by head, VW tokens at a time (tokens past n score a copy of the last row, never read);
 * the query's vectors stay in registers across its tokens. qs: the scaled queries, split;
 * `ahead` is stepped once per head and token. */
static inline __attribute__((always_inline)) void bf16_tile_scores(const float *qs, const char *krow, int64_t ts,
                                                                   int64_t n, int64_t nk, int64_t group,
                                                                   const int64_t D, float (*s)[TILE], Spread *ahead) {
    const int64_t pairs = D / BF16_PAIR_CHUNK;
    for (int64_t h = 0; h < nk * group; h++) {
        const float *q = qs + h * D;
        const uint16_t *k = (const uint16_t *)krow + (h / group) * D;
        vf qe[BF16_MAX_PAIRS], qo[BF16_MAX_PAIRS];
        for (int64_t i = 0; i < pairs; i++)
            qe[i] = *(const vfu *)(q + i * BF16_PAIR_CHUNK), qo[i] = *(const vfu *)(q + i * BF16_PAIR_CHUNK + VW);
        for (int64_t t0 = 0; t0 < n; t0 += VW) {
            vf acc[VW];
            for (int64_t j = 0; j < VW; j++) {
                spread_step(ahead);
                const uint16_t *kt = k + (t0 + j < n ? t0 + j : n - 1) * ts;
                vu w = *(const vuu *)kt;
                vf a = qe[0] * bf16_even(w) + qo[0] * bf16_odd(w);
                for (int64_t i = 1; i < pairs; i++) {
                    w = *(const vuu *)(kt + i * BF16_PAIR_CHUNK);
                    a += qe[i] * bf16_even(w);
                    a += qo[i] * bf16_odd(w);
                }
                acc[j] = a;
            }
            *(vfu *)(s[h] + t0) = tree_sum(acc);
        }
    }
}

/* accumulate_v's loop on split accumulators, a KV head's query heads `gn` at a time: each V row
 * is widened once for all of them, and their 2 * gn * pairs accumulators are independent sums (one
 * head's few would chain every token's products on the add latency). Each head's sum is the same,
 * in the same token order, as head by head. */
static inline __attribute__((always_inline)) void bf16_accumulate_heads(const uint16_t *vh, int64_t ts, int64_t n,
                                                                        const int64_t D, const float (*s)[TILE],
                                                                        const float *rescale, float *acc,
                                                                        const int gn) {
    const int64_t pairs = D / BF16_PAIR_CHUNK;
    vf re[BF16_HEADS][BF16_MAX_PAIRS], ro[BF16_HEADS][BF16_MAX_PAIRS];
    for (int j = 0; j < gn; j++)
        for (int64_t i = 0; i < pairs; i++) {
            re[j][i] = *(const vfu *)(acc + j * D + i * BF16_PAIR_CHUNK) * rescale[j];
            ro[j][i] = *(const vfu *)(acc + j * D + i * BF16_PAIR_CHUNK + VW) * rescale[j];
        }
    for (int64_t t = 0; t < n; t++) {
        for (int64_t i = 0; i < pairs; i++) {
            const vu x = *(const vuu *)(vh + t * ts + i * BF16_PAIR_CHUNK);
            const vf e = bf16_even(x), o = bf16_odd(x);
            for (int j = 0; j < gn; j++) {
                const float w = s[j][t];
                re[j][i] += w * e;
                ro[j][i] += w * o;
            }
        }
    }
    for (int j = 0; j < gn; j++)
        for (int64_t i = 0; i < pairs; i++) {
            *(vfu *)(acc + j * D + i * BF16_PAIR_CHUNK) = re[j][i];
            *(vfu *)(acc + j * D + i * BF16_PAIR_CHUNK + VW) = ro[j][i];
        }
}

static inline __attribute__((always_inline)) void bf16_accumulate_v(const char *vb, int64_t ts, int64_t n, int64_t nk,
                                                                    int64_t group, const int64_t D,
                                                                    float (*s)[TILE], const float *rescale, float *acc,
                                                                    Spread *ahead) {
    /* Heads per pass: their accumulators in at most 16 vectors (all of them at D = 64, VW = 16). */
    const int64_t per = 16 / (2 * (D / BF16_PAIR_CHUNK)) < 1 ? 1 : 16 / (2 * (D / BF16_PAIR_CHUNK));
    const int64_t hp = per < BF16_HEADS ? per : BF16_HEADS;
    for (int64_t kh = 0; kh < nk; kh++) {
        const uint16_t *vh = (const uint16_t *)vb + kh * D;
        for (int64_t g0 = 0; g0 < group; g0 += hp) {
            const int64_t h = kh * group + g0, gn = group - g0 < hp ? group - g0 : hp;
            for (int64_t j = 0; j < gn; j++) spread_step(ahead);
#define BF16_HEADS_CASE(G) bf16_accumulate_heads(vh, ts, n, D, (const float (*)[TILE])s + h, rescale + h, acc + h * D, G)
            switch (gn) {
                case 4: BF16_HEADS_CASE(4); break;
                case 3: BF16_HEADS_CASE(3); break;
                case 2: BF16_HEADS_CASE(2); break;
                default: BF16_HEADS_CASE(1); break;
            }
#undef BF16_HEADS_CASE
        }
    }
}
