/* Paged decode attention for the CPU torch backend.
 *
 * One query token per sequence attends to its context through the block
 * table, reading K/V in place from the paged cache: no gathered copy. Decode
 * is bound by memory bandwidth, so the kernel is built around how K/V is read:
 *
 * - Each K/V row is read once, in one pass: tiles of up to TILE tokens inside
 *   one block are scored, folded into a running (online) softmax, and their V
 *   rows accumulated while the tile's K rows were just read.
 * - A task takes every KV head of its rows (as many as fit MAX_TASK_FLOATS of
 *   queries in L1), so it reads whole token rows, [KVH, D] contiguous, and a
 *   block's rows one after the other; the query heads of a GQA group share each
 *   K/V load. (One task per KV head read a quarter of every row and left the
 *   hardware prefetcher short, random blocks stride-jumping at every block.)
 * - Blocks are scattered, so the hardware prefetcher loses the stream at every
 *   block boundary: each token prefetches the row PREFETCH tokens ahead, found
 *   through the block table. The prefetches are paced: a row's K lines are spread
 *   over the dot products that score a token, its V lines over the V accumulation
 *   of each head. One burst per row (32 lines at once) filled the core's miss
 *   buffers, stalling the loads behind it; paced, attention over cold K/V ran
 *   1.07-1.34x faster on W1's tail shapes. The prefetches go to L2 (locality 2,
 *   prefetcht1), not L1: the loads then find a row in L2, a few cycles away, and
 *   the lines on their way are not capped by L1's few miss buffers. On W1-shaped
 *   cold K/V this took a bf16 call from ~120 to ~90 ns per token row on one thread
 *   (a bare read of the same blocks: ~85), float32 from ~225 to ~130.
 * - Split-K: long contexts are cut into chunks so that 2 threads get about
 *   TASKS_PER_THREAD tasks each even with a single sequence; each chunk keeps
 *   an unnormalised partial (running max, sum, weighted V) that a second pass
 *   merges. A sequence in one chunk is normalised in place.
 * - Scores are float32; exp is a polynomial that vectorises over a tile (libm's
 *   expf is a scalar call per score); the 1/sum normalisation is applied once.
 * - New K/V rows of the step can be written first, in the same call
 *   (reshape_and_cache fused: no extra dispatch per layer).
 * - Logit soft-capping (Gemma 2): with cap > 0 every score s becomes
 *   cap * tanh(s / cap) before the softmax, as transformers' eager attention does.
 * - The caches hold float32, bfloat16, float16 or fp8 e4m3 (the _f32, _bf16, _f16 and _fp8 entry
 *   points): the half types halve the bytes every step reads, fp8 quarters them. Both widen exactly to float32 in registers: a
 *   bf16 is the top half of a float32's bits (a shift), a float16 goes through vcvtph2ps (F16C,
 *   on every x86-64-v3 CPU; AVX-512F's 16-wide form), or bit manipulation where neither is
 *   built in. Scores, softmax and accumulation stay float32, and one source serves every
 *   element type (kv_load / kv_vec, specialised by a constant `elt`). New rows arrive as
 *   float32 and are rounded to nearest even as they are written, as torch's .to() rounds.
 * - A bfloat16 cache is read as 32-bit pairs of elements, each widened in one instruction, its
 *   scores summed a tile of tokens at a time (paged_decode_bf16.h).
 * - Consecutive rows of one sequence (a prefill's prompt tokens, each a row) are attended in
 *   tiles of rows, every tile of keys read once for all of them (paged_decode_runs.h).
 * - fp8 (--kv-cache-dtype fp8, float8_e4m3fn) stores x / scale with one scale per layer for K and
 *   one for V; its widening, rounding and entry points are in paged_decode_fp8.h. The scales are
 *   applied outside the inner loops: K's folded into the query scale (q . (s k) = s (q . k)), V's
 *   into the final 1 / sum. An fp8 byte widens through vcvtph2ps too, to its value / 2^8, and the
 *   2^8 goes into the scaled queries and V's weights, exactly.
 *
 * q:           [B, H, D]                float32
 * k/v cache:   [NB, BS, KVH, D]         float32, bfloat16, float16 or fp8 e4m3 (bytes)
 * block_table: [B, max_blocks]          int64
 * seq_lens:    [B]                      int64
 * out:         [B, H, D]                float32
 * k/v_new:     [N, KVH, D], slots [N]   float32 rows to write first (N may be 0)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_TASK_FLOATS 4096 /* query heads x head size of one task: 16 KiB of queries, as much of accumulators */
#define MAX_TASK_HEADS 128
/* The tuning knobs below can be overridden with -D (bench: interleaved builds). */
#ifndef TILE
#define TILE 16
#endif
#ifndef PREFETCH
#define PREFETCH 16 /* tokens ahead: one block of the default size, ~1.5 us of work at head size 64 */
#endif
#ifndef TASKS_PER_THREAD
#define TASKS_PER_THREAD 8
#endif
#ifndef SERIAL_TOKENS
#define SERIAL_TOKENS 256 /* context tokens under which waking a second thread costs more than it saves */
#endif
#ifndef MIN_CHUNK
#define MIN_CHUNK 64 /* tokens: below this a chunk's set-up and merge cost more than its share of the reads */
#endif

/* exp(x) for x <= 0 (scores minus their running max), Cephes-style: x = n ln2 + r
 * with |r| <= ln2/2, a degree-6 polynomial for e^r, and 2^n built in the
 * exponent bits. Relative error about 2e-7; plain float code, so it vectorises. */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x; /* also maps -inf (first tile's max) to ~1e-38 */
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return e * two_n.f;
}

/* cap * tanh(s / cap), tanh from exp_neg so that a tile's scores vectorise (libm's tanhf is a
 * scalar call): tanh|x| = (1 - e) / (1 + e) with e = e^(-2|x|) in (0, 1]. Its absolute error is
 * about that of e, 2e-7, so a capped score is off by ~cap * 2e-7: a unit or two in the last
 * place of scores near the cap, and what matters to a softmax is the absolute error. */
static inline float soft_cap(float s, float cap) {
    const float x = s / cap;
    const float e = exp_neg(-2.f * (x < 0.f ? -x : x));
    const float t = (1.f - e) / (1.f + e);
    return (x < 0.f ? -t : t) * cap;
}

typedef struct {
    const char *k, *v;      /* caches, offset to the task's first KV head */
    const int64_t *table;   /* the sequence's block table */
    int64_t block_size, block_stride, token_stride;
} Paged;

typedef struct {
    int64_t b, kh0, nk;     /* sequence, first KV head, KV heads */
    int64_t lo, hi;         /* context positions [lo, hi) */
    int64_t part;           /* partial record, or -1: the whole context, write out normalised */
} Task;

/* Offset (in elements) of position pos's K/V row in the caches. */
static inline int64_t row_at(const Paged *p, int64_t pos) {
    return p->table[pos / p->block_size] * p->block_stride + (pos % p->block_size) * p->token_stride;
}

/* Prefetches of whole rows (every 64-byte line), handed out evenly over the `steps` iterations
 * of a loop by error diffusion (no division inside the loop): spread_step once per iteration. */
typedef struct {
    const char *const *rows;
    int64_t row, off, credit, lines, steps, row_bytes;
} Spread;

static inline Spread spread(const char *const *rows, int64_t num_rows, int64_t row_bytes, int64_t steps) {
    return (Spread){rows, 0, 0, 0, num_rows * ((row_bytes + 63) / 64), steps, row_bytes};
}

static inline void spread_step(Spread *s) {
    for (s->credit += s->lines; s->credit >= s->steps; s->credit -= s->steps) {
        __builtin_prefetch(s->rows[s->row] + s->off, 0, 2);
        if ((s->off += 64) >= s->row_bytes) s->off = 0, s->row++;
    }
}

/* The widest vectors -march=native offers, as GCC vector types (no intrinsics: any ISA builds). */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define VCHUNK 8 /* vectors of one head's accumulator kept in registers at a time */
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef float vfu __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float)))); /* unaligned */
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vbu __attribute__((vector_size(VW * sizeof(uint16_t)), aligned(sizeof(uint16_t)))); /* unaligned */
typedef uint8_t vb8 __attribute__((vector_size(VW), aligned(1)));                                         /* unaligned */

/* float16 -> float32, exactly, without F16C: the exponent rebiased (112 = 127 - 15), an
 * infinity or NaN's exponent saturated, a subnormal (or zero) renormalised by one float
 * subtraction, exact because its result is a float32 normal (so FTZ/DAZ cannot touch it).
 * Written once for scalars and once for GCC vectors, where each comparison is a lane mask. */
#define F16_EXP (0x7c00u << 13) /* a float16's exponent field, where a float32's sits */
static inline float f16_widen_bits(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    const uint32_t exp = o & F16_EXP;
    o += 112u << 23;
    if (exp == F16_EXP) o += 112u << 23; /* infinity or NaN: exponent 255, payload kept */
    float f;
    if (exp == 0) { /* m * 2^-24 = (1 + m / 2^10) * 2^-14 - 2^-14 */
        o += 1u << 23;
        memcpy(&f, &o, sizeof f);
        f -= 0x1p-14f;
        memcpy(&o, &f, sizeof o);
    }
    o |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &o, sizeof f);
    return f;
}

/* float32 -> float16, to nearest even, integers only (no MXCSR): ties to even, overflow at
 * 65520 (the tie between 65504 and 2^16) to infinity, subnormals kept, a NaN a quiet NaN. */
static inline uint16_t f16_round_bits(float x) {
    uint32_t a;
    memcpy(&a, &x, sizeof a);
    const uint16_t sign = (uint16_t)((a >> 16) & 0x8000u);
    a &= 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520, or an infinity */
    if (a >= 0x38800000u) {                      /* >= 2^-14: a normal float16 */
        a -= 112u << 23;                         /* rebiased; rounding up may carry into the exponent */
        return sign | (uint16_t)((a + 0xfffu + ((a >> 13) & 1u)) >> 13);
    }
    if (a <= 0x33000000u) return sign; /* <= 2^-25, half the smallest subnormal: a tie to even 0 */
    /* A subnormal in units of 2^-24: the 24-bit significand shifted right by 126 - exponent (14..24). */
    const uint32_t shift = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (uint16_t)(h + (rest > half || (rest == half && (h & 1u)))); /* 0x400: up to 2^-14 */
}

/* float32 -> bfloat16, to nearest even, as torch's .to(torch.bfloat16): the bias carries a
 * tie up only when the kept half is odd. A NaN is kept a (quiet) NaN: its payload may sit
 * in the low half only, and rounding would carry it into the exponent (an infinity). */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float32 -> float16 as torch's .to(torch.float16): vcvtps2ph with the rounding in its
 * immediate (MXCSR's mode and FTZ do not apply), or the integer routine above. */
static inline uint16_t to_f16(float x) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return f16_round_bits(x);
#endif
}

/* fp8 e4m3 elements: widened and rounded in paged_decode_fp8.h, which is included at the end of
 * this file with the fp8 entry points (they call paged_decode below). A widened element is its
 * value / FP8_UNIT (a half's bits, converted in one instruction); attend() multiplies the queries
 * and V's softmax weights by FP8_UNIT instead, exactly (see paged_decode_fp8.h). */
#define FP8_UNIT 0x1p8f
#if (VW == 16 && defined(__AVX512F__)) || (VW == 8 && defined(__F16C__))
#define FP8_VCVT 1 /* vcvtph2ps widens fp8 */
#else
#define FP8_VCVT 0
#endif
static inline float fp8_widen_bits(uint8_t b);
static inline vf fp8_widen_vec(const uint8_t *p);
static inline uint8_t to_fp8(float x);
static void to_fp8_row(uint8_t *dst, const float *row, int64_t n, float scale);

/* Cache elements. Every caller passes elt as a constant into always_inline code, so each
 * element type gets its own loops with no test inside them. */
enum kv_elt { KV_F32, KV_BF16, KV_F16, KV_FP8 };

static inline int64_t kv_bytes(int64_t elems, const enum kv_elt elt) {
    return elems * (elt == KV_FP8 ? 1 : elt != KV_F32 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
}

static inline const char *kv_at(const char *base, int64_t elems, const enum kv_elt elt) {
    return base + kv_bytes(elems, elt);
}

static inline float kv_load(const char *p, int64_t i, const enum kv_elt elt) {
    if (elt == KV_F32) return ((const float *)p)[i];
    if (elt == KV_FP8) return fp8_widen_bits(((const uint8_t *)p)[i]);
    if (elt == KV_F16) {
#if defined(__F16C__)
        return _cvtsh_ss(((const uint16_t *)p)[i]);
#else
        return f16_widen_bits(((const uint16_t *)p)[i]);
#endif
    }
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f); /* folded into a register move: the dot products still vectorise */
    return f;
}

static inline vf f16_widen_vec(const uint16_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VW == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    const vu h = __builtin_convertvector(*(const vbu *)p, vu);
    vu o = (h & 0x7fffu) << 13;
    const vu exp = o & F16_EXP, special = (vu)(exp == F16_EXP), tiny = (vu)(exp == 0);
    o += (112u << 23) + (special & (112u << 23));
    const vu renormal = (vu)((vf)(o + (1u << 23)) - 0x1p-14f); /* as f16_widen_bits */
    o = (tiny & renormal) | (~tiny & o);
    return (vf)(o | (h & 0x8000u) << 16);
#endif
}

static inline vf kv_vec(const char *p, int64_t i, const enum kv_elt elt) {
    if (elt == KV_F32) return *(const vfu *)((const float *)p + i);
    if (elt == KV_F16) return f16_widen_vec((const uint16_t *)p + i);
    if (elt == KV_FP8) return fp8_widen_vec((const uint8_t *)p + i);
    return (vf)(__builtin_convertvector(*(const vbu *)((const uint16_t *)p + i), vu) << 16);
}

#include "paged_decode_bf16.h"

/* q . k over D elements. A float16 or fp8 row is widened a vector at a time (a scalar conversion
 * would keep the loop from vectorising); the other types' scalar loads vectorise as they are. */
static inline __attribute__((always_inline)) float dot_qk(const float *q, const char *k, const int64_t D,
                                                         const enum kv_elt elt) {
    float dot = 0.f;
    if (elt != KV_F16 && elt != KV_FP8) {
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += q[d] * kv_load(k, d, elt);
        return dot;
    }
    vf acc = {0};
    int64_t d = 0;
    if (elt == KV_FP8) {
        /* -fassociative-math lets GCC rebalance the chain of a completely unrolled loop, and it
         * unrolls one completely or not by the body's size: fp8's order is pinned instead, a
         * row of up to 8 vectors unrolled (and rebalanced), a longer one summed in order, so that
         * its scores do not move with how many instructions the widening takes. */
#pragma GCC unroll 8
        for (; d + VW <= D; d += VW) acc += *(const vfu *)(q + d) * kv_vec(k, d, elt);
    } else {
        for (; d + VW <= D; d += VW) acc += *(const vfu *)(q + d) * kv_vec(k, d, elt);
    }
    for (int i = 0; i < VW; i++) dot += acc[i];
    for (; d < D; d++) dot += q[d] * kv_load(k, d, elt);
    return dot;
}

/* acc[h] = acc[h] * rescale[h] + sum over the tile's tokens t of s[h][t] * V[t, KV head of h];
 * `ahead` prefetches the V rows whose K the score pass prefetched.
 * Head by head, a chunk of the accumulator stays in registers across the tile's tokens
 * (token by token, it would be loaded and stored once per token and head, and the store port
 * would bound the loop); V rows come from L1, where the score pass just brought the tile's K. */
static inline __attribute__((always_inline)) void accumulate_v(
    const char *vb, int64_t ts, int64_t n, int64_t nk, int64_t group, const int64_t D, float (*s)[TILE],
    const float *rescale, float *acc, Spread *ahead, const enum kv_elt elt) {
    for (int64_t h = 0; h < nk * group; h++) {
        spread_step(ahead);
        float *a = acc + h * D;
        const char *vh = kv_at(vb, (h / group) * D, elt);
        if (D % VW != 0) {
            for (int64_t d = 0; d < D; d++) a[d] *= rescale[h];
            for (int64_t t = 0; t < n; t++)
                for (int64_t d = 0; d < D; d++) a[d] += s[h][t] * kv_load(vh, t * ts + d, elt);
            continue;
        }
        for (int64_t c = 0; c < D; c += VCHUNK * VW) {
            const int64_t nv = (D - c) / VW < VCHUNK ? (D - c) / VW : VCHUNK;
            vf r[VCHUNK];
            for (int64_t i = 0; i < nv; i++) r[i] = *(const vfu *)(a + c + i * VW) * rescale[h];
            for (int64_t t = 0; t < n; t++) {
                const float w = s[h][t];
                for (int64_t i = 0; i < nv; i++) {
                    r[i] += w * kv_vec(vh, t * ts + c + i * VW, elt);
#if FP8_VCVT
                    /* fp8's V sums in token order: with the widening a few instructions, GCC
                     * otherwise reassociates them (-fassociative-math) where D is not a constant,
                     * and the outputs' rounding would depend on it. */
                    if (elt == KV_FP8) __asm__("" : "+v"(r[i]));
#endif
                }
            }
            for (int64_t i = 0; i < nv; i++) *(vfu *)(a + c + i * VW) = r[i];
        }
    }
}

/* Online-softmax attention of nh = nk * group query heads over positions [lo, hi).
 * Leaves unnormalised acc [nh, D], running max m [nh] and sum l [nh].
 * Inlined into each call site below, so where the caller passes a literal head
 * size the compiler sees a constant D and keeps the dot products and V rows in
 * vector registers; the generic call serves any other size. */
static inline __attribute__((always_inline)) void attend(
    const Paged *p, const float *q, int64_t lo, int64_t hi, int64_t nk, int64_t group, const int64_t D,
    float scale, float cap, float *acc, float *m, float *l, const enum kv_elt elt) {
    const int64_t nh = nk * group, ts = p->token_stride;
    float qs[MAX_TASK_FLOATS], s[MAX_TASK_HEADS][TILE], rescale[MAX_TASK_HEADS];
    for (int64_t i = 0; i < nh * D; i++) qs[i] = q[i] * scale;
    if (elt == KV_FP8) {
        /* A pass of its own behind a barrier: -fassociative-math could otherwise fold the two
         * multiplies into q * (scale * FP8_UNIT), rounded differently where q * scale is a float32
         * subnormal. Rounded first, then times a power of two, qs is exactly FP8_UNIT times what
         * the other types score with. */
        __asm__ volatile("" : : "r"(qs) : "memory");
        for (int64_t i = 0; i < nh * D; i++) qs[i] *= FP8_UNIT;
    }
    const int pairs = bf16_pairs(D, elt, p->block_size);
    if (pairs)
        for (int64_t h = 0; h < nh; h++) bf16_split(qs + h * D, D);
    memset(acc, 0, sizeof(float) * (size_t)(nh * D));
    for (int64_t h = 0; h < nh; h++) m[h] = -INFINITY, l[h] = 0.f;
    for (int64_t pos = lo; pos < hi;) {
        const int64_t off = pos % p->block_size;
        int64_t n = p->block_size - off;
        if (n > hi - pos) n = hi - pos;
        if (n > TILE) n = TILE;
        const int64_t base = row_at(p, pos);
        const char *kb = kv_at(p->k, base, elt), *vb = kv_at(p->v, base, elt);
        const int64_t row_bytes = kv_bytes(nk * D, elt);
        const char *k_ahead[TILE], *v_ahead[TILE]; /* rows PREFETCH tokens ahead of this tile's */
        int64_t ahead = 0, t = 0;
        for (; PREFETCH > 0 && t < n && pos + t + PREFETCH < hi; t++, ahead++) {
            const int64_t at = row_at(p, pos + t + PREFETCH);
            k_ahead[t] = kv_at(p->k, at, elt), v_ahead[t] = kv_at(p->v, at, elt);
        }
        if (pairs) {
            Spread pf = spread(k_ahead, ahead, row_bytes, nh * ((n + VW - 1) / VW * VW));
            bf16_tile_scores(qs, kb, ts, n, nk, group, D, s, &pf);
        } else {
            for (t = 0; t < n; t++) {
                Spread pf = spread(k_ahead + t, t < ahead, row_bytes, nh);
                for (int64_t kh = 0; kh < nk; kh++) {
                    const char *kp = kv_at(kb, t * ts + kh * D, elt);
                    for (int64_t g = 0; g < group; g++) {
                        spread_step(&pf);
                        s[kh * group + g][t] = dot_qk(qs + (kh * group + g) * D, kp, D, elt);
                    }
                }
            }
        }
        if (cap > 0.f)
            for (int64_t h = 0; h < nh; h++)
#pragma omp simd
                for (int64_t t = 0; t < n; t++) s[h][t] = soft_cap(s[h][t], cap);
        for (int64_t h = 0; h < nh; h++) {
            float mx = m[h];
            /* A max is exact in any order: vectorised, it cut the hot (cached K/V) time ~15 %. */
#pragma omp simd reduction(max : mx)
            for (int64_t t = 0; t < n; t++) mx = s[h][t] > mx ? s[h][t] : mx;
            const float corr = exp_neg(m[h] - mx); /* ~0 on the first tile: m = -inf */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                const float e = exp_neg(s[h][t] - mx);
                sum += e;
                /* V's weight; fp8's times FP8_UNIT, exact: e is a float32 normal (exp_neg clamps
                 * at -87, e^-87 > 2^-126), so each weighted V element is the same product. */
                s[h][t] = elt == KV_FP8 ? e * FP8_UNIT : e;
            }
            l[h] = l[h] * corr + sum;
            m[h] = mx;
            rescale[h] = corr;
        }
        Spread pv = spread(v_ahead, ahead, row_bytes, nh);
        if (pairs)
            bf16_accumulate_v(vb, ts, n, nk, group, D, s, rescale, acc, &pv);
        else
            accumulate_v(vb, ts, n, nk, group, D, s, rescale, acc, &pv, elt);
        pos += n;
    }
    if (pairs)
        for (int64_t h = 0; h < nh; h++) bf16_unsplit(acc + h * D, D);
}

#define RUN_TASK_PARAMS                                                                                   \
    const Task *task, const float *q, const char *k_cache, const char *v_cache, const int64_t *block_table, \
        int64_t max_blocks, int64_t num_heads, int64_t group, int64_t D, int64_t block_size,                \
        int64_t token_stride, float scale, float cap, float v_scale, float *out, float *parts
#define RUN_TASK_ARGS                                                                                            \
    task, q, k_cache, v_cache, block_table, max_blocks, num_heads, group, D, block_size, token_stride, scale, cap, \
        v_scale, out, parts

static inline __attribute__((always_inline)) void run_task_as(RUN_TASK_PARAMS, const enum kv_elt elt) {
    const Paged p = {kv_at(k_cache, task->kh0 * D, elt), kv_at(v_cache, task->kh0 * D, elt),
                     block_table + task->b * max_blocks, block_size, block_size * token_stride, token_stride};
    const int64_t h0 = task->kh0 * group, nh = task->nk * group;
    const float *qh = q + (task->b * num_heads + h0) * D;
    float local[MAX_TASK_FLOATS], lm[MAX_TASK_HEADS], ll[MAX_TASK_HEADS];
    /* A partial record: acc [H, D], then m [H], then l [H]. */
    float *rec = task->part < 0 ? NULL : parts + task->part * num_heads * (D + 2);
    float *acc = rec ? rec + h0 * D : local;
    float *m = rec ? rec + num_heads * D + h0 : lm, *l = rec ? rec + num_heads * (D + 1) + h0 : ll;
#define ATTEND(DIM, ELT) attend(&p, qh, task->lo, task->hi, task->nk, group, DIM, scale, cap, acc, m, l, ELT)
#define ATTEND_ANY_D(ELT)   \
    if (D == 64)            \
        ATTEND(64, ELT);    \
    else if (D == 128)      \
        ATTEND(128, ELT);   \
    else                    \
        ATTEND(D, ELT)
    if (elt == KV_F16) {
        ATTEND_ANY_D(KV_F16);
    } else if (elt == KV_FP8) {
        ATTEND_ANY_D(KV_FP8);
    } else if (elt == KV_BF16) {
        ATTEND_ANY_D(KV_BF16);
    } else {
        ATTEND_ANY_D(KV_F32);
    }
#undef ATTEND_ANY_D
#undef ATTEND
    if (rec) return;
    float *oh = out + (task->b * num_heads + h0) * D;
    for (int64_t h = 0; h < nh; h++) {
        const float inv = l[h] > 0.f ? v_scale / l[h] : 0.f; /* v_scale 1 but for fp8: the same bits */
        for (int64_t d = 0; d < D; d++) oh[h * D + d] = acc[h * D + d] * inv;
    }
}

/* float16's loops in a function of their own: compiled into one function with the float32 and
 * bfloat16 loops, they changed those loops' register allocation (bf16 decode from a hot cache
 * ran ~7 % slower). The select below tells the compiler run_task never sees float16. */
static __attribute__((noinline)) void run_task_f16(RUN_TASK_PARAMS) { run_task_as(RUN_TASK_ARGS, KV_F16); }
/* fp8's too, for the same reason. */
static __attribute__((noinline)) void run_task_fp8(RUN_TASK_PARAMS) { run_task_as(RUN_TASK_ARGS, KV_FP8); }

static void run_task(RUN_TASK_PARAMS, const enum kv_elt elt) {
    if (elt == KV_F16)
        run_task_f16(RUN_TASK_ARGS);
    else if (elt == KV_FP8)
        run_task_fp8(RUN_TASK_ARGS);
    else
        run_task_as(RUN_TASK_ARGS, elt == KV_BF16 ? KV_BF16 : KV_F32);
}

#include "paged_decode_runs.h"

/* out[b] = sum over its chunks c of acc_c * e^(m_c - M) / sum of l_c * e^(m_c - M), M = max m_c. */
static void merge(const float *parts, int64_t first, int64_t count, int64_t num_heads, int64_t D, float v_scale,
                  float *out) {
    const int64_t rec = num_heads * (D + 2);
    for (int64_t h = 0; h < num_heads; h++) {
        float mx = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < count; c++) {
            const float mc = parts[(first + c) * rec + num_heads * D + h];
            mx = mc > mx ? mc : mx;
        }
        float *o = out + h * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < count; c++) {
            const float *r = parts + (first + c) * rec;
            const float w = exp_neg(r[num_heads * D + h] - mx);
            sum += r[num_heads * (D + 1) + h] * w;
            for (int64_t d = 0; d < D; d++) o[d] += w * r[h * D + d];
        }
        const float inv = sum > 0.f ? v_scale / sum : 0.f;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* float32 rows -> float16, a vector at a time where vcvtps2ph is built in (to nearest even by
 * its immediate, as to_f16), the tail one by one. */
static void to_f16_row(uint16_t *dst, const float *row, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(row + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(row + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) dst[j] = to_f16(row[j]);
}

/* kv_scale: fp8's scale, by which a value is divided (a true division, as vLLM's a / scale) before
 * it is rounded; unused by the other types. */
static void write_rows(void *cache, const float *rows, const int64_t *slots, int64_t n, int64_t token_stride,
                       enum kv_elt elt, float kv_scale) {
    for (int64_t i = 0; i < n; i++) {
        const float *row = rows + i * token_stride;
        if (elt == KV_F32) {
            memcpy((float *)cache + slots[i] * token_stride, row, sizeof(float) * (size_t)token_stride);
            continue;
        }
        if (elt == KV_FP8) {
            uint8_t *dst = (uint8_t *)cache + slots[i] * token_stride;
            to_fp8_row(dst, row, token_stride, kv_scale);
            continue;
        }
        uint16_t *dst = (uint16_t *)cache + slots[i] * token_stride;
        if (elt == KV_F16) {
            to_f16_row(dst, row, token_stride);
            continue;
        }
        for (int64_t j = 0; j < token_stride; j++) dst[j] = to_bf16(row[j]);
    }
}

static int64_t attended(int64_t len, int64_t window) { return (window > 0 && len > window) ? window : len; }

/* Tokens per chunk: about TASKS_PER_THREAD tasks per thread over the batch, at least MIN_CHUNK,
 * a whole number of blocks (chunks start on block boundaries). */
static int64_t chunk_tokens(int64_t total, int64_t block_size, int num_threads) {
    const int64_t target = (int64_t)(num_threads > 0 ? num_threads : 1) * TASKS_PER_THREAD;
    int64_t chunk = (total + target - 1) / target;
    if (chunk < MIN_CHUNK) chunk = MIN_CHUNK;
    return (chunk + block_size - 1) / block_size * block_size;
}

/* Chunks of sequence b: its window's first block to its end. */
static int64_t num_chunks(int64_t len, int64_t window, int64_t block_size, int64_t chunk) {
    const int64_t aligned = (len - attended(len, window)) / block_size * block_size;
    return (len - aligned + chunk - 1) / chunk;
}

/* Fills tasks (chunk by chunk, KV-head range by range) and first_part [batch + 1]: sequence b's
 * partial records are first_part[b] .. first_part[b + 1] - 1, none when it is one chunk. */
static void fill_tasks(Task *tasks, int64_t *first_part, const int64_t *seq_lens, int64_t batch, int64_t window,
                       int64_t block_size, int64_t chunk, int64_t nk, int64_t num_kv_heads, const char *in_run) {
    int64_t t = 0, part = 0;
    for (int64_t b = 0; b < batch; b++) {
        first_part[b] = part;
        if (in_run && in_run[b]) continue; /* a tile of its run's attends it */
        const int64_t len = seq_lens[b], start = len - attended(len, window);
        const int64_t aligned = start / block_size * block_size, chunks = num_chunks(len, window, block_size, chunk);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t lo = aligned + c * chunk, hi = lo + chunk < len ? lo + chunk : len;
            for (int64_t kh0 = 0; kh0 < num_kv_heads; kh0 += nk)
                tasks[t++] = (Task){b, kh0, kh0 + nk <= num_kv_heads ? nk : num_kv_heads - kh0,
                                    lo > start ? lo : start, hi, chunks > 1 ? part + c : -1};
        }
        part += chunks > 1 ? chunks : 0;
    }
    first_part[batch] = part;
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing computed).
 * cap > 0: scores are soft-capped (see soft_cap); 0: as they are. elt: the caches' element type.
 * k_scale, v_scale: an fp8 cache's scales (1 for the other types, where they change no bit). */
static int paged_decode(const float *q, void *k_cache, void *v_cache, const int64_t *block_table,
                        const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                        int num_threads, const float *k_new, const float *v_new, const int64_t *slots,
                        int64_t num_new, float cap, enum kv_elt elt, float k_scale, float v_scale) {
    const int64_t group = num_heads / num_kv_heads, D = head_dim, token_stride = num_kv_heads * D;
    write_rows(k_cache, k_new, slots, num_new, token_stride, elt, k_scale);
    write_rows(v_cache, v_new, slots, num_new, token_stride, elt, v_scale);
    scale *= k_scale; /* the scores of the dequantized keys: scale * (q . k_scale k) */
    /* KV heads per task: all of them for the usual shapes (12 x 64 floats of queries for Llama-small). */
    int64_t nk = num_kv_heads;
    while (nk > 1 && (nk * group * D > MAX_TASK_FLOATS || nk * group > MAX_TASK_HEADS)) nk = (nk + 1) / 2;
    const int64_t ranges = (num_kv_heads + nk - 1) / nk;
    /* One sequence's rows (a prefill's prompt tokens) in tiles of rows where they run long enough. */
    char *in_run = NULL;
    RowTile *row_tiles = NULL;
    int64_t num_row_tiles = 0;
    if (batch >= RUN_MIN && runs_apply(D, group, elt)) {
        if ((in_run = calloc((size_t)batch, 1)) == NULL) return -1;
        num_row_tiles = find_runs(block_table, max_blocks, seq_lens, batch, block_size, window, num_kv_heads, D,
                                  group, in_run, NULL);
        if (num_row_tiles && (row_tiles = malloc(sizeof(RowTile) * (size_t)num_row_tiles)) == NULL) {
            free(in_run);
            return -1;
        }
        find_runs(block_table, max_blocks, seq_lens, batch, block_size, window, num_kv_heads, D, group, in_run,
                  row_tiles);
    }
    int64_t total = 0, num_tasks = 0, num_parts = 0;
    for (int64_t b = 0; b < batch; b++) total += attended(seq_lens[b], window) * ranges;
    const int64_t chunk = chunk_tokens(total, block_size, num_threads);
    for (int64_t b = 0; b < batch; b++) {
        if (in_run && in_run[b]) continue;
        const int64_t chunks = num_chunks(seq_lens[b], window, block_size, chunk);
        num_tasks += chunks * ranges;
        num_parts += chunks > 1 ? chunks : 0;
    }
    Task *tasks = malloc(sizeof(Task) * (size_t)(num_tasks ? num_tasks : 1));
    int64_t *first_part = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    float *parts = num_parts ? malloc(sizeof(float) * (size_t)(num_parts * num_heads * (D + 2))) : NULL;
    if (!tasks || !first_part || (num_parts && !parts)) {
        free(tasks), free(first_part), free(parts), free(in_run), free(row_tiles);
        return -1;
    }
    fill_tasks(tasks, first_part, seq_lens, batch, window, block_size, chunk, nk, num_kv_heads, in_run);
#pragma omp parallel num_threads(num_threads) if (total > SERIAL_TOKENS)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < num_row_tiles; i++)
            run_rows(&row_tiles[i], q, k_cache, v_cache, block_table, max_blocks, seq_lens, num_heads, group, D,
                     block_size, token_stride, scale, cap, out, elt);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++)
            run_task(&tasks[i], q, k_cache, v_cache, block_table, max_blocks, num_heads, group, D, block_size,
                     token_stride, scale, cap, v_scale, out, parts, elt);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++)
            if (first_part[b + 1] > first_part[b])
                merge(parts, first_part[b], first_part[b + 1] - first_part[b], num_heads, D, v_scale,
                      out + b * num_heads * D);
    }
    free(tasks), free(first_part), free(parts), free(in_run), free(row_tiles);
    return 0;
}

/* The entry points: float32, bfloat16 or float16 caches, with or without soft-capping (fp8's, with
 * the layer's scales: paged_decode_fp8.h). The uncapped ones are what worker/csrc/decoder_f32.c
 * calls through a pointer (its attn). */
#define PAGED_DECODE_PARAMS(T)                                                                                    \
    const float *q, T *k_cache, T *v_cache, const int64_t *block_table, const int64_t *seq_lens, float *out,      \
        int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,             \
        int64_t max_blocks, float scale, int64_t window, int num_threads, const float *k_new, const float *v_new, \
        const int64_t *slots, int64_t num_new
#define PAGED_DECODE_ARGS                                                                                       \
    q, k_cache, v_cache, block_table, seq_lens, out, batch, num_heads, num_kv_heads, head_dim, block_size,     \
        max_blocks, scale, window, num_threads, k_new, v_new, slots, num_new

int paged_decode_capped_f32(PAGED_DECODE_PARAMS(float), float cap) {
    return paged_decode(PAGED_DECODE_ARGS, cap, KV_F32, 1.f, 1.f);
}

int paged_decode_f32(PAGED_DECODE_PARAMS(float)) { return paged_decode(PAGED_DECODE_ARGS, 0.f, KV_F32, 1.f, 1.f); }

int paged_decode_capped_bf16(PAGED_DECODE_PARAMS(uint16_t), float cap) {
    return paged_decode(PAGED_DECODE_ARGS, cap, KV_BF16, 1.f, 1.f);
}

int paged_decode_bf16(PAGED_DECODE_PARAMS(uint16_t)) { return paged_decode(PAGED_DECODE_ARGS, 0.f, KV_BF16, 1.f, 1.f); }

int paged_decode_capped_f16(PAGED_DECODE_PARAMS(uint16_t), float cap) {
    return paged_decode(PAGED_DECODE_ARGS, cap, KV_F16, 1.f, 1.f);
}

int paged_decode_f16(PAGED_DECODE_PARAMS(uint16_t)) { return paged_decode(PAGED_DECODE_ARGS, 0.f, KV_F16, 1.f, 1.f); }

#include "paged_decode_fp8.h"
