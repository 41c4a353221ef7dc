/* Float32 y = x @ W^T (+ bias) over bfloat16 weights with Intel AMX-BF16 tiles
 * (Sapphire Rapids and later), for the CPU linear layers' bf16 weights.
 *
 * Same arguments and same packed W as gemm_bf16_dot in gemm_bf16.c (read that
 * first): the "dot" panels [ceil(N / 32), ceil(K / 2), 32, 2] of bf16 bits,
 * k-pairs in 32-bit lanes, which is AMX's VNNI layout already. One pair-row of a
 * panel is 32 features x 2 bf16 = 128 bytes, so the panel's two 16-feature
 * halves are two B tiles (16 pair-rows x 64 bytes) loaded with a 128-byte
 * stride, the second 64 bytes after the first. x is rounded to bf16 (nearest
 * even, a NaN stays NaN: gemm_bf16.c's routine) into thread-local scratch as
 * pairs, the rows padded with zeros to a multiple of 16 and the pairs to a
 * multiple of 16 (32 bf16, one A tile row of 64 bytes), so an A tile never
 * reads past the scratch; the last, partial k-block of a panel is copied into
 * a zeroed 2 KiB buffer before its B tiles load, so nothing reads past W; C
 * tiles of 16 valid rows and 32 valid columns are stored straight into y,
 * others into a small buffer from which only the valid rows and columns reach
 * y; the bias is added after the sum, as torch's addmm adds it. Zero padding only
 * ever meets zero padding (padded k of x against padded k of W), or lands in
 * rows / columns that are thrown away, so a NaN or an infinity can't leak.
 *
 * Blocking: threads split the panels (never K, never M), as gemm_bf16.c, so a
 * result depends neither on the thread count nor on the batch's other rows.
 * Within a thread: rows in blocks of MB, panels inner (a block's rounded rows
 * stay in L2 while its panels stream by); within a panel, rows by 32: two A
 * tiles (rows 0-15, 16-31) x two B tiles (features 0-15, 16-31) -> four C tiles
 * (tmm0-3) held over the whole K loop, 16 k-pairs per step (A in tmm4-5, B in
 * tmm6-7: all eight tiles 16 rows x 64 bytes, one configuration). A last block
 * of 16 rows uses one A tile and two C tiles. Every output is summed over its
 * k-blocks in order, by the same instruction sequence whatever M or the thread
 * split, hence the invariances. MB is not tuned on AMX hardware (none here).
 *
 * The tile operations go through TILE_* macros with two implementations picked
 * at compile time; everything above them is the same code:
 * - -DNORIA_AMX_EMULATE: plain C on a thread-local array of 8 tile registers of
 *   1 KiB, honoring each tile's rows / colsb from the configuration (loads zero
 *   the rest of a register, as the hardware does) and checking the operand
 *   shapes where the hardware would fault (#UD / #GP here: abort with a
 *   message). TDPBF16PS follows the SDM's pseudo-code (Vol. 2B): per row m of
 *   C, two float32 accumulators per column n (even and odd bf16 of the pairs),
 *   zeroed, then for each k-pair of the tile, for each column, the FMA of the
 *   even products into the even accumulator and of the odd ones into the odd
 *   one; then per column tmp = even + odd and C[m][n] = C[m][n] + tmp. (The
 *   Intrinsics Guide's pseudo-code differs: one chain through C itself. We
 *   follow the SDM, the architectural reference.) The SDM's "DAZ=FTZ=1, RNE" is
 *   applied to every FMA and add: an input (bf16 value, accumulator, C element)
 *   with a zero exponent field counts as a zero of its sign; a result that is
 *   tiny -- below 2^-126 in magnitude once rounded to 24 bits with unbounded
 *   exponent, which is x86's MXCSR.FTZ rule (tininess after rounding) -- becomes
 *   a zero of its sign. Infinities and NaNs propagate (which NaN is not modelled).
 * - otherwise the compiler's _tile_* intrinsics (-mamx-tile -mamx-bf16).
 *   GCC's tile load / store macros are asm statements without a memory clobber,
 *   so the macros fence them with compiler barriers: stores into the staging
 *   buffer can't sink below a tile load, nor reads of the C buffer rise above a
 *   tile store.
 *
 * Tile state: each thread loads the configuration on entry to its share of a
 * call and releases the tiles when done (tilerelease). Not once per thread for
 * good: other AMX users on the same threads (oneDNN inside torch) load their own
 * configurations and release between our calls, so a remembered "configured"
 * flag would go stale (wrong shapes, or #UD after their release). ldtilecfg
 * costs far less than one 32 x 32 x K block. Before the first tile instruction
 * Linux needs the process to ask for the tile data state
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), else SIGILL);
 * gemm_amx_ready() asks once per process and says whether it was granted.
 *
 * x:      [M, K] float32, row stride ldx
 * packed: [ceil(N / 32), ceil(K / 2), 32, 2] bf16 bits (pack_bf16_dot with NR = 32)
 * bias:   [N] float32 or NULL
 * y:      [M, N] float32, row stride ldy
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the pair lanes assume a little-endian CPU"
#endif

#if !defined(NORIA_AMX_EMULATE) && defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AMX_INT8__)
#define AMX_REAL 1
#include <immintrin.h>
#endif

#define NR 32         /* features per panel: the dot layout on AVX-512 hosts */
#define TR 16         /* rows of a tile */
#define TK 16         /* k-pairs of an A tile row, pair-rows of a B tile (64 bytes) */
#define PAIR_ROW (2 * NR) /* bf16 values per pair-row of a panel (128 bytes) */
#define MB 128        /* rows per block (a multiple of 32) */

/* ldtilecfg's 64-byte operand, palette 1. */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
_Static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

int gemm_amx_built(void) {
#ifdef AMX_REAL
    return 1;
#else
    return 0;
#endif
}

int gemm_amx_emulated(void) {
#ifdef NORIA_AMX_EMULATE
    return 1;
#else
    return 0;
#endif
}

/* ---- whether the CPU and the OS let this process run tile instructions ---- */

static int ready_state = -1; /* -1 not asked yet, 0 no, 1 yes */
static const char *ready_reason = "not checked";

static void check_ready(void) {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) {
        ready_reason = "the CPU has no AMX-TILE / AMX-BF16 (CPUID.(7,0):EDX bits 24, 22)";
        return;
    }
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
        ready_reason = "the OS has not enabled XSAVE (CPUID.1:ECX.OSXSAVE)";
        return;
    }
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) {
        ready_reason = "the OS has not enabled the tile state in XCR0 (Linux before 5.16?)";
        return;
    }
    /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18; process-wide. */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        ready_reason = errno == ENOSPC
            ? "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: a thread's sigaltstack is too small for the tile state"
            : "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused by the kernel";
        return;
    }
    unsigned long granted = 0; /* ARCH_GET_XCOMP_PERM = 0x1022 */
    if (syscall(SYS_arch_prctl, 0x1022, &granted) != 0 || !(granted & (1ul << 18))) {
        ready_reason = "the kernel did not grant the tile data state";
        return;
    }
    ready_reason = "ready";
    __atomic_store_n(&ready_state, 1, __ATOMIC_RELEASE);
    return;
#else
    ready_reason = "AMX needs x86-64 Linux";
#endif
}

/* Whether the CPU has AMX-BF16 and Linux granted the tile data state (asked once
 * per process; asking again is harmless, so racing first callers are fine). */
int gemm_amx_ready(void) {
    int s = __atomic_load_n(&ready_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        check_ready();
        if (__atomic_load_n(&ready_state, __ATOMIC_ACQUIRE) != 1) __atomic_store_n(&ready_state, 0, __ATOMIC_RELEASE);
        s = __atomic_load_n(&ready_state, __ATOMIC_ACQUIRE);
    }
    return s;
}

const char *gemm_amx_ready_reason(void) {
    gemm_amx_ready();
    return ready_reason;
}

static int int8_state = -1; /* -1 not asked yet */

/* gemm_amx_ready, and the CPU has AMX-INT8 too (CPUID.(7,0):EDX bit 25; asked once: under a
 * hypervisor CPUID traps). */
int gemm_amx_int8_ready(void) {
    int s = __atomic_load_n(&int8_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = 0;
#if defined(__x86_64__) && defined(__linux__)
        unsigned a, b, c, d;
        s = gemm_amx_ready() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
#endif
        __atomic_store_n(&int8_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* ---- the tile operations: the one place the two builds differ ---- */

#ifdef NORIA_AMX_EMULATE

static _Thread_local struct {
    int configured;
    TileConfig cfg;
    _Alignas(64) uint8_t reg[8][TR][64];
} emu;

static void emu_fault(const char *what) {
    fprintf(stderr, "gemm_amx (emulated tiles): %s\n", what);
    abort();
}

static void emu_config(const TileConfig *cfg) {
    if (cfg->palette_id > 1 || cfg->start_row != 0) emu_fault("#GP in ldtilecfg: palette or start_row");
    for (int i = 0; i < 14; i++)
        if (cfg->reserved[i]) emu_fault("#GP in ldtilecfg: reserved bytes set");
    for (int t = 0; t < 16; t++) {
        const int r = cfg->rows[t], cb = cfg->colsb[t];
        if (t >= 8 || cfg->palette_id == 0) {
            if (r || cb) emu_fault("#GP in ldtilecfg: a tile outside the palette configured");
        } else if (r > TR || cb > 64 || (r == 0) != (cb == 0)) {
            emu_fault("#GP in ldtilecfg: a tile's rows / colsb");
        }
    }
    emu.cfg = *cfg;
    emu.configured = cfg->palette_id == 1;
    memset(emu.reg, 0, sizeof emu.reg); /* ldtilecfg zeroes the tile data */
}

static void emu_release(void) {
    emu.configured = 0;
    memset(&emu.cfg, 0, sizeof emu.cfg);
    memset(emu.reg, 0, sizeof emu.reg);
}

static void emu_need(int t) {
    if (!emu.configured || emu.cfg.rows[t] == 0) emu_fault("#UD: a tile instruction on an unconfigured tile");
}

static void emu_load(int t, const void *base, int64_t stride) {
    emu_need(t);
    const int rows = emu.cfg.rows[t], cb = emu.cfg.colsb[t];
    memset(emu.reg[t], 0, sizeof emu.reg[t]);
    for (int r = 0; r < rows; r++) memcpy(emu.reg[t][r], (const char *)base + r * stride, (size_t)cb);
}

static void emu_store(int t, void *base, int64_t stride) {
    emu_need(t);
    const int rows = emu.cfg.rows[t], cb = emu.cfg.colsb[t];
    for (int r = 0; r < rows; r++) memcpy((char *)base + r * stride, emu.reg[t][r], (size_t)cb);
}

static void emu_zero(int t) {
    emu_need(t);
    memset(emu.reg[t], 0, sizeof emu.reg[t]);
}

/* DAZ: a zero exponent field counts as a zero of its sign (NaN and inf pass). */
static inline float daz(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.0f, v) : v; }

/* The bf16 element's float32 (make_fp32), DAZ applied. */
static inline float bf16_in(uint16_t h) {
    if ((h & 0x7f80u) == 0) h &= 0x8000u;
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* FTZ of an IEEE-rounded result r, on the terms of the SDM (and MXCSR.FTZ):
 * zero when tiny after rounding. r below 2^-126 means the exact value was below
 * 2^-126 - 2^-150, tiny either way. */
static inline float ftz(float r) { return fabsf(r) < FLT_MIN ? copysignf(0.0f, r) : r; }

/* c + a * b, one rounding (RNE), DAZ on a, b, c, FTZ on the result. */
static float fma_daz_ftz(float a, float b, float c) {
    a = daz(a), b = daz(b), c = daz(c);
    const float r = fmaf(a, b, c);
    if (fabsf(r) < FLT_MIN) return copysignf(0.0f, r);
    if (fabsf(r) == FLT_MIN && a != 0.0f && b != 0.0f) {
        /* IEEE rounding onto the subnormal grid took an exact value in
         * [2^-126 - 2^-150, 2^-126) up to 2^-126, but at 24 bits with unbounded
         * exponent the values below 2^-126 - 2^-151 round to 2^-126 - 2^-150:
         * tiny, so flushed. Redo the FMA 2^24 times larger, an exact scaling
         * (an a or c past 2^104, which would overflow, can't end this close to
         * 2^-126: its lowest bits lie far above it), to see which. */
        const float s = fmaf(a * 0x1p24f, b, c * 0x1p24f);
        if (fabsf(s) < 0x1p-102f) return copysignf(0.0f, r);
    }
    return r;
}

/* a + b, DAZ in, FTZ out. A sum that lands below 2^-126 is exact (both are
 * normal or zero), so tininess before or after rounding agree. */
static inline float add_daz_ftz(float a, float b) { return ftz(daz(a) + daz(b)); }

/* TDPBF16PS c, a, b per the SDM. */
static void emu_dpbf16ps(int c, int a, int b) {
    emu_need(c), emu_need(a), emu_need(b);
    const TileConfig *k = &emu.cfg;
    if (c == a || c == b || a == b) emu_fault("#UD in tdpbf16ps: tiles not all different");
    if (k->colsb[c] % 4 || k->colsb[a] % 4 || k->colsb[c] != k->colsb[b] || k->colsb[a] / 4 != k->rows[b] ||
        k->rows[c] != k->rows[a])
        emu_fault("#UD in tdpbf16ps: operand shapes do not match");
    const int rows = k->rows[c], pairs = k->colsb[a] / 4, cols = k->colsb[c] / 4;
    for (int m = 0; m < rows; m++) {
        float temp[32] = {0};
        const uint16_t *arow = (const uint16_t *)emu.reg[a][m];
        for (int kk = 0; kk < pairs; kk++) {
            const float a0 = bf16_in(arow[2 * kk]), a1 = bf16_in(arow[2 * kk + 1]);
            const uint16_t *brow = (const uint16_t *)emu.reg[b][kk];
            for (int n = 0; n < cols; n++) {
                temp[2 * n] = fma_daz_ftz(a0, bf16_in(brow[2 * n]), temp[2 * n]);
                temp[2 * n + 1] = fma_daz_ftz(a1, bf16_in(brow[2 * n + 1]), temp[2 * n + 1]);
            }
        }
        float *crow = (float *)emu.reg[c][m];
        for (int n = 0; n < cols; n++) crow[n] = add_daz_ftz(crow[n], add_daz_ftz(temp[2 * n], temp[2 * n + 1]));
    }
}

/* TDPBUSD c, a, b per the SDM: per row m of C and column n, the products of
 * A's unsigned bytes by B's signed ones, four per dword, summed into a dword
 * that wraps (no saturation), then added to C[m][n], wrapping too. */
static void emu_dpbusd(int c, int a, int b) {
    emu_need(c), emu_need(a), emu_need(b);
    const TileConfig *k = &emu.cfg;
    if (c == a || c == b || a == b) emu_fault("#UD in tdpbusd: tiles not all different");
    if (k->colsb[c] % 4 || k->colsb[a] % 4 || k->colsb[c] != k->colsb[b] || k->colsb[a] / 4 != k->rows[b] ||
        k->rows[c] != k->rows[a])
        emu_fault("#UD in tdpbusd: operand shapes do not match");
    const int rows = k->rows[c], quads = k->colsb[a] / 4, cols = k->colsb[c] / 4;
    for (int m = 0; m < rows; m++) {
        const uint8_t *arow = emu.reg[a][m];
        uint32_t *crow = (uint32_t *)emu.reg[c][m];
        for (int n = 0; n < cols; n++) {
            uint32_t tmp = 0;
            for (int q = 0; q < quads; q++) {
                const int8_t *bq = (const int8_t *)emu.reg[b][q] + 4 * n;
                for (int i = 0; i < 4; i++) tmp += (uint32_t)((int32_t)arow[4 * q + i] * (int32_t)bq[i]);
            }
            crow[n] += tmp;
        }
    }
}

#define TILE_CONFIG(cfg) emu_config(cfg)
#define TILE_RELEASE() emu_release()
#define TILE_LOAD(t, base, stride) emu_load((t), (base), (stride))
#define TILE_STORE(t, base, stride) emu_store((t), (base), (stride))
#define TILE_ZERO(t) emu_zero(t)
#define TILE_DP(c, a, b) emu_dpbf16ps((c), (a), (b))
#define TILE_DPBUSD(c, a, b) emu_dpbusd((c), (a), (b))
#define HAVE_TILES 1

#elif defined(AMX_REAL)

#define BARRIER() __asm__ volatile("" ::: "memory")
#define TILE_CONFIG(cfg) do { BARRIER(); _tile_loadconfig(cfg); BARRIER(); } while (0)
#define TILE_RELEASE() do { BARRIER(); _tile_release(); BARRIER(); } while (0)
#define TILE_LOAD(t, base, stride) do { BARRIER(); _tile_loadd(t, (base), (stride)); BARRIER(); } while (0)
#define TILE_STORE(t, base, stride) do { BARRIER(); _tile_stored(t, (base), (stride)); BARRIER(); } while (0)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define HAVE_TILES 1

#endif

/* ---- everything below is the same code for both builds ---- */

#ifdef HAVE_TILES

/* All eight tiles 16 rows x 64 bytes. */
static const TileConfig kernel_config = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {TR, TR, TR, TR, TR, TR, TR, TR},
};

#include "bf16_round.h"

/* Rows [m0, m1) of the padded A operand: row m < M is x's row as bf16 pairs (k even
 * in the low half, an odd K's last pair padded with 0), zeros from pair K2 to K2p;
 * rows from M on are zeros. */
static void round_rows(const float *x, int64_t ldx, uint32_t *x2, int64_t M, int64_t K, int64_t K2p, int64_t m0,
                       int64_t m1) {
    const int64_t K2 = (K + 1) / 2;
    for (int64_t m = m0; m < m1; m++) {
        uint32_t *dst = x2 + m * K2p;
        if (m >= M) {
            memset(dst, 0, sizeof(uint32_t) * (size_t)K2p);
            continue;
        }
        const float *src = x + m * ldx;
        round_pairs(src, dst, K);
        memset(dst + K2, 0, sizeof(uint32_t) * (size_t)(K2p - K2));
    }
}

static _Thread_local uint32_t *scratch;
static _Thread_local size_t scratch_size;

static uint32_t *scratch_for(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (scratch == NULL) {
            fprintf(stderr, "gemm_amx: out of memory for %zu bytes of rounded activations\n", bytes);
            abort();
        }
        scratch_size = bytes;
    }
    return scratch;
}

/* 32 rows (two = 1) or 16 rows (two = 0) of A, from `a` (row stride K2p pairs),
 * against one panel: rows 0-15 into c[r * ldc + j], rows 16-31 into c2[(r - 16) *
 * ldc2 + j], j < 32. `blocks` k-blocks of 16 pairs; block kb < full is in the
 * panel, the last one (if any) in `tail`. */
static inline __attribute__((always_inline)) void rows_x_panel(
    const uint32_t *a, int64_t K2p, const uint16_t *panel, int64_t full, int64_t blocks, const uint16_t *tail,
    const int two, float *c, int64_t ldc, float *c2, int64_t ldc2) {
    const int64_t sa = K2p * (int64_t)sizeof(uint32_t), sb = PAIR_ROW * (int64_t)sizeof(uint16_t);
    TILE_ZERO(0);
    TILE_ZERO(1);
    if (two) {
        TILE_ZERO(2);
        TILE_ZERO(3);
    }
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint16_t *b = kb < full ? panel + kb * TK * PAIR_ROW : tail;
        TILE_LOAD(6, b, sb);      /* features 0-15 */
        TILE_LOAD(7, b + NR, sb); /* features 16-31: the second 64 bytes of each pair-row */
        TILE_LOAD(4, a + kb * TK, sa);
        TILE_DP(0, 4, 6);
        TILE_DP(1, 4, 7);
        if (two) {
            TILE_LOAD(5, a + TR * K2p + kb * TK, sa);
            TILE_DP(2, 5, 6);
            TILE_DP(3, 5, 7);
        }
    }
    const int64_t sc = ldc * (int64_t)sizeof(float), sc2 = ldc2 * (int64_t)sizeof(float);
    TILE_STORE(0, c, sc);
    TILE_STORE(1, c + TR, sc);
    if (two) {
        TILE_STORE(2, c2, sc2);
        TILE_STORE(3, c2 + TR, sc2);
    }
}

/* Panels [p0, p1) for all rows, on the calling thread, tiles configured. */
static void panel_range(const uint32_t *x2, int64_t K2p, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t Mp, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    const int64_t K2 = (K + 1) / 2, psize = K2 * PAIR_ROW, full = K2 / TK, blocks = K2p / TK;
    _Alignas(64) uint16_t tail[TK * PAIR_ROW]; /* the partial k-block, zero-padded: 2 KiB */
    _Alignas(64) float c[2 * TR][NR];
    for (int64_t m0 = 0; m0 < Mp; m0 += MB) {
        const int64_t m1 = Mp - m0 < MB ? Mp : m0 + MB;
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *panel = packed + p * psize;
            if (blocks > full) {
                const int64_t rest = K2 - full * TK;
                memset(tail, 0, sizeof tail);
                memcpy(tail, panel + full * TK * PAIR_ROW, sizeof(uint16_t) * (size_t)(rest * PAIR_ROW));
            }
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            for (int64_t r0 = m0; r0 < m1; r0 += 2 * TR) {
                const int two = r0 + TR < m1;
                const int64_t h = M - r0 < 2 * TR ? M - r0 : 2 * TR;
                /* A half (16 rows) of whole tiles goes straight into y (copying every
                 * staged row took 3 % of a bf16 W1); the edges pass through c. */
                const int top = ncols == NR && h >= TR, bottom = ncols == NR && h == 2 * TR;
                float *yr = y + r0 * ldy + n0;
                float *c_top = top ? yr : &c[0][0], *c_bottom = bottom ? yr + TR * ldy : &c[TR][0];
                const int64_t ld_top = top ? ldy : NR, ld_bottom = bottom ? ldy : NR;
                if (two)
                    rows_x_panel(x2 + r0 * K2p, K2p, panel, full, blocks, tail, 1, c_top, ld_top, c_bottom, ld_bottom);
                else
                    rows_x_panel(x2 + r0 * K2p, K2p, panel, full, blocks, tail, 0, c_top, ld_top, c_bottom, ld_bottom);
                for (int64_t r = 0; r < h; r++) {
                    float *out = y + (r0 + r) * ldy + n0;
                    if (r < TR ? top : bottom) {
                        if (bias != NULL)
                            for (int64_t j = 0; j < NR; j++) out[j] += bias[n0 + j];
                    } else if (bias == NULL)
                        memcpy(out, c[r], sizeof(float) * (size_t)ncols);
                    else
                        for (int64_t j = 0; j < ncols; j++) out[j] = c[r][j] + bias[n0 + j];
                }
            }
        }
    }
}

static inline void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t tid = 0, nth = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    nth = omp_get_num_threads();
#endif
    *lo = n * tid / nth, *hi = n * (tid + 1) / nth;
}


/* ---- W8A8 on AMX-INT8 tiles (TDPBUSD), for gemm_quant.c's gemm_w8a8 ---- */

#include "w8a8_out.h"

#define Q4_BLOCK 16 /* k-quads of a k-block: one A tile row (64 bytes), one B tile's rows */
#define I8_NR 64    /* features of a W8A8 panel on the 512-bit VNNI build: four B tiles */

/* C tiles 0-3 (16 rows x 64 features) += one k-block: A (16 rows x 64 unsigned bytes, row stride
 * lda) against four B tiles of 16 features, side by side in quad rows of row_bytes. */
static inline __attribute__((always_inline)) void dpbusd_block(const uint8_t *a, int64_t lda, const int8_t *b,
                                                                int64_t row_bytes) {
    TILE_LOAD(4, a, lda);
    TILE_LOAD(5, b, row_bytes);
    TILE_LOAD(6, b + 64, row_bytes);
    TILE_DPBUSD(0, 4, 5);
    TILE_LOAD(7, b + 128, row_bytes);
    TILE_DPBUSD(1, 4, 6);
    TILE_LOAD(5, b + 192, row_bytes);
    TILE_DPBUSD(2, 4, 7);
    TILE_DPBUSD(3, 4, 5);
}

#define TILES_ZERO4() do { TILE_ZERO(0); TILE_ZERO(1); TILE_ZERO(2); TILE_ZERO(3); } while (0)

/* C tiles 0-3 into c, 64 int32 a row. */
static inline __attribute__((always_inline)) void tiles_store4(int32_t c[TR][I8_NR]) {
    const int64_t stride = I8_NR * (int64_t)sizeof(int32_t);
    TILE_STORE(0, &c[0][0], stride);
    TILE_STORE(1, &c[0][16], stride);
    TILE_STORE(2, &c[0][32], stride);
    TILE_STORE(3, &c[0][48], stride);
}

/* Rows [0, M) of gemm_w8a8's quantized activations against its panels [p0, p1), on the
 * calling thread (gemm_w8a8 splits the panels or the rows over its threads, then calls
 * this where it has set it: gemm_quant_set_w8a8_tiles).
 * xq: [>= ceil(M / 16) * 16, ldq] bytes, q + 128 (unsigned), ldq a multiple of 64 with
 *     the padding 128 (x = 0): every A tile lies inside it.
 * packed: [panels, K4, 64, 4] int8, gemm_w8a8's 512-bit layout. A k-block of 16 quads
 *     of 16 features is one B tile as it lies (64 bytes a quad, the panel's 256-byte
 *     quad rows as its stride), so a panel is four B tiles a block; a last, partial
 *     block is copied into a zeroed buffer first (nothing reads past W, and the
 *     padded k of x meets zero weights).
 * Per 16 rows, four C tiles (a panel's 64 features) are summed over all k-blocks, in
 * int32 that wraps exactly as vpdpbusd's lanes do, so each sum equals the vpdpbusd
 * kernel's; w8a8_out makes the same floats of it. */
void gemm_amx_w8a8_range(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *packed,
                         const int32_t *corr, const float *sw, const float *bias, float *y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K4, int64_t nr, int64_t p0, int64_t p1) {
    if (nr != I8_NR || ldq % (4 * Q4_BLOCK) != 0) {
        fprintf(stderr, "gemm_amx_w8a8_range: panels of %lld features, rows of %lld bytes; the tiles take 64, "
                "and a multiple of 64\n", (long long)nr, (long long)ldq);
        abort();
    }
#ifdef AMX_REAL
    if (!gemm_amx_int8_ready()) {
        fprintf(stderr, "gemm_amx_w8a8_range: AMX-INT8 is not usable here (%s)\n", ready_reason);
        abort();
    }
#endif
    const int64_t row_bytes = I8_NR * 4, blocks = ldq / (4 * Q4_BLOCK), full = K4 / Q4_BLOCK;
    _Alignas(64) int8_t tail[Q4_BLOCK * I8_NR * 4]; /* 4 KiB */
    _Alignas(64) int32_t c[TR][I8_NR];
    TILE_CONFIG(&kernel_config);
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *panel = packed + p * K4 * row_bytes;
        if (blocks > full) {
            memset(tail, 0, sizeof tail);
            memcpy(tail, panel + full * Q4_BLOCK * row_bytes, (size_t)((K4 - full * Q4_BLOCK) * row_bytes));
        }
        const int64_t n0 = p * I8_NR, ncols = N - n0 < I8_NR ? N - n0 : I8_NR;
        for (int64_t r0 = 0; r0 < M; r0 += TR) {
            TILES_ZERO4();
            for (int64_t kb = 0; kb < blocks; kb++)
                dpbusd_block(xq + r0 * ldq + kb * 4 * Q4_BLOCK, ldq,
                             kb < full ? panel + kb * Q4_BLOCK * row_bytes : tail, row_bytes);
            tiles_store4(c);
            const int64_t h = M - r0 < TR ? M - r0 : TR;
            for (int64_t r = 0; r < h; r++) {
                float out[I8_NR];
                w8a8_out(c[r], corr + n0, sx[r0 + r], sw + n0, bias == NULL ? NULL : bias + n0, out, I8_NR);
                memcpy(y + (r0 + r) * ldy + n0, out, sizeof(float) * (size_t)ncols);
            }
        }
    }
    TILE_RELEASE();
}


/* ---- W4A8 on AMX-INT8 tiles, for gemm_quant.c's group_gemm ---- */

#include "group_out.h"

static _Thread_local uint8_t *w4_buf;
static _Thread_local size_t w4_size;

static uint8_t *w4_scratch(size_t bytes) {
    if (bytes > w4_size) {
        free(w4_buf);
        w4_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (w4_buf == NULL) {
            fprintf(stderr, "gemm_amx: out of memory for %zu bytes of decoded weights\n", bytes);
            abort();
        }
        w4_size = bytes;
    }
    return w4_buf;
}

/* Rows [0, M) of group_gemm's activations against 4-bit panels [p0, p1), on the calling thread
 * (group_gemm splits the panels or the rows over its threads, as for vpdpbusd).
 * xu: [>= ceil(M / 16) * 16, ldu] bytes, qx + 128 (quant_groups' signed values made unsigned);
 *     K and the group multiples of 64, so a group is whole k-blocks of A tiles.
 * packed: gemm_w4a8's [panels, K / 4, 2, 64] nibble panels (64 features: byte b of chunk j holds
 *     16-feature vector j's byte b low, vector j + 2's high); each panel is decoded once per call
 *     into bytes u = q + off in W8A8's layout [K / 4, 64, 4], whose 64-byte quad rows of 16
 *     features are B tiles as they lie, and each feature's sum of u per group taken beside.
 * Per 16 rows and group, C = sum (qx + 128) * u over the group (TDPBUSD, wrapping int32), so
 * C - 128 * colsum is vpdpbusd's sum qx * u exactly, and group_out makes the same totals of it;
 * then the bias, as q4_tile adds it. zeros: NULL or [panels, G, 64] (zero + off); scales
 * [panels, G, 64]; sx, xsum: [M, G]. No minimums (group_gemm keeps those on vpdpbusd). */
void gemm_amx_w4a8_range(const uint8_t *xu, int64_t ldu, const float *sx, const int32_t *xsum, int64_t G,
                         const uint8_t *packed, const uint8_t *zeros, const float *scales, int32_t off,
                         const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group,
                         int64_t nr, int64_t p0, int64_t p1) {
    if (nr != I8_NR || group % (4 * Q4_BLOCK) != 0 || K % group != 0) {
        fprintf(stderr, "gemm_amx_w4a8_range: panels of %lld features, group %lld, K %lld; the tiles take 64 "
                "features and groups of a multiple of 64\n", (long long)nr, (long long)group, (long long)K);
        abort();
    }
#ifdef AMX_REAL
    if (!gemm_amx_int8_ready()) {
        fprintf(stderr, "gemm_amx_w4a8_range: AMX-INT8 is not usable here (%s)\n", ready_reason);
        abort();
    }
#endif
    const int64_t K4 = K / 4, row_bytes = I8_NR * 4, gblocks = group / (4 * Q4_BLOCK), gk4 = group / 4;
    uint8_t *u = w4_scratch((size_t)(K4 * row_bytes) + sizeof(int32_t) * (size_t)(G * I8_NR));
    int32_t *colsum = (int32_t *)(u + K4 * row_bytes);
    _Alignas(64) int32_t c[TR][I8_NR];
    _Alignas(64) float tot[TR][I8_NR];
    TILE_CONFIG(&kernel_config);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = packed + p * K4 * (I8_NR * 2);
        for (int64_t k4 = 0; k4 < K4; k4++) {
            const uint8_t *src = panel + k4 * (I8_NR * 2);
            uint8_t *dst = u + k4 * row_bytes;
            for (int j = 0; j < 2; j++)
                for (int b = 0; b < 64; b++) {
                    dst[j * 64 + b] = src[j * 64 + b] & 15;
                    dst[(j + 2) * 64 + b] = src[j * 64 + b] >> 4;
                }
        }
        for (int64_t g = 0; g < G; g++) {
            int32_t *cs = colsum + g * I8_NR;
            for (int f = 0; f < I8_NR; f++) cs[f] = 0;
            for (int64_t k4 = g * gk4; k4 < (g + 1) * gk4; k4++) {
                /* A feature's 4 bytes are one 32-bit lane: summed in the lane (vectorizes). */
                const uint32_t *lane = (const uint32_t *)(u + k4 * row_bytes);
                for (int f = 0; f < I8_NR; f++) {
                    const uint32_t v = (lane[f] & 0x00ff00ffu) + ((lane[f] >> 8) & 0x00ff00ffu);
                    cs[f] += (int32_t)((v & 0xffffu) + (v >> 16));
                }
            }
        }
        const int64_t n0 = p * I8_NR, ncols = N - n0 < I8_NR ? N - n0 : I8_NR;
        const float *sc = scales + p * G * I8_NR;
        const uint8_t *ze = zeros == NULL ? NULL : zeros + p * G * I8_NR;
        for (int64_t r0 = 0; r0 < M; r0 += TR) {
            const int64_t h = M - r0 < TR ? M - r0 : TR;
            memset(tot, 0, sizeof tot);
            for (int64_t g = 0; g < G; g++) {
                TILES_ZERO4();
                for (int64_t kb = 0; kb < gblocks; kb++) {
                    const int64_t k4 = g * gk4 + kb * Q4_BLOCK;
                    dpbusd_block(xu + r0 * ldu + 4 * k4, ldu, (const int8_t *)(u + k4 * row_bytes), row_bytes);
                }
                tiles_store4(c);
                const int32_t *cs = colsum + g * I8_NR;
                for (int64_t r = 0; r < h; r++) {
                    int32_t sums[I8_NR];
                    for (int j = 0; j < I8_NR; j++) sums[j] = (int32_t)((uint32_t)c[r][j] - 128u * (uint32_t)cs[j]);
                    const int64_t m = r0 + r;
                    group_out(sums, tot[r], xsum[m * G + g], sx[m * G + g], 0.0f, sc + g * I8_NR,
                              ze == NULL ? NULL : ze + g * I8_NR, NULL, off, 0, ze != NULL, 0, I8_NR);
                }
            }
            for (int64_t r = 0; r < h; r++) {
                if (bias != NULL)
                    for (int j = 0; j < I8_NR; j++) tot[r][j] += bias[n0 + j];
                memcpy(y + (r0 + r) * ldy + n0, tot[r], sizeof(float) * (size_t)ncols);
            }
        }
    }
    TILE_RELEASE();
}

#endif /* HAVE_TILES */

#ifndef HAVE_TILES
void gemm_amx_w4a8_range(const uint8_t *xu, int64_t ldu, const float *sx, const int32_t *xsum, int64_t G,
                         const uint8_t *packed, const uint8_t *zeros, const float *scales, int32_t off,
                         const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t group,
                         int64_t nr, int64_t p0, int64_t p1) {
    (void)xu, (void)ldu, (void)sx, (void)xsum, (void)G, (void)packed, (void)zeros, (void)scales, (void)off;
    (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)group, (void)nr, (void)p0, (void)p1;
    fprintf(stderr, "gemm_amx_w4a8_range: built without AMX tiles (check gemm_amx_built)\n");
    abort();
}

void gemm_amx_w8a8_range(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *packed,
                         const int32_t *corr, const float *sw, const float *bias, float *y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K4, int64_t nr, int64_t p0, int64_t p1) {
    (void)xq, (void)ldq, (void)sx, (void)packed, (void)corr, (void)sw, (void)bias, (void)y, (void)ldy, (void)M;
    (void)N, (void)K4, (void)nr, (void)p0, (void)p1;
    fprintf(stderr, "gemm_amx_w8a8_range: built without AMX tiles (check gemm_amx_built)\n");
    abort();
}
#endif

/* Same arguments as gemm_bf16_dot; `packed` from pack_bf16_dot with NR = 32. */
void gemm_amx(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
              int64_t M, int64_t N, int64_t K, int num_threads) {
#ifdef HAVE_TILES
#ifdef AMX_REAL
    if (!gemm_amx_ready()) {
        fprintf(stderr, "gemm_amx: AMX is not usable here (%s); check gemm_amx_ready\n", ready_reason);
        abort();
    }
#endif
    if (M <= 0 || N <= 0) return;
    const int64_t panels = (N + NR - 1) / NR, K2 = (K + 1) / 2;
    const int64_t K2p = (K2 + TK - 1) / TK * TK, Mp = (M + TR - 1) / TR * TR;
    const size_t bytes = sizeof(uint32_t) * (size_t)(Mp * K2p);
    uint32_t *x2 = bytes ? scratch_for(bytes) : NULL;
    const int threads = panels < num_threads ? (int)panels : (num_threads > 0 ? num_threads : 1);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t m0, m1, p0, p1;
        thread_share(Mp, &m0, &m1);
        if (x2 != NULL) round_rows(x, ldx, x2, M, K, K2p, m0, m1);
#pragma omp barrier
        thread_share(panels, &p0, &p1);
        TILE_CONFIG(&kernel_config);
        panel_range(x2, K2p, packed, bias, y, ldy, M, Mp, N, K, p0, p1);
        TILE_RELEASE();
    }
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    fprintf(stderr, "gemm_amx: built without AMX tiles (check gemm_amx_built)\n");
    abort();
#endif
}

/* gemm_bf16_dot_panels' contract on the tiles: every row of x against panels [p0, p1),
 * on the calling thread alone (a caller's parallel region splits the work: the MoE
 * experts' one call, moe_f32.c). Each output is the same sum as gemm_amx's. */
void gemm_amx_panels(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
#ifdef HAVE_TILES
#ifdef AMX_REAL
    if (!gemm_amx_ready()) {
        fprintf(stderr, "gemm_amx_panels: AMX is not usable here (%s); check gemm_amx_ready\n", ready_reason);
        abort();
    }
#endif
    if (M <= 0 || N <= 0 || p1 <= p0) return;
    const int64_t K2 = (K + 1) / 2, K2p = (K2 + TK - 1) / TK * TK, Mp = (M + TR - 1) / TR * TR;
    const size_t bytes = sizeof(uint32_t) * (size_t)(Mp * K2p);
    uint32_t *x2 = bytes ? scratch_for(bytes) : NULL;
    if (x2 != NULL) round_rows(x, ldx, x2, M, K, K2p, 0, Mp);
    TILE_CONFIG(&kernel_config);
    panel_range(x2, K2p, packed, bias, y, ldy, M, Mp, N, K, p0, p1);
    TILE_RELEASE();
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)p0, (void)p1;
    fprintf(stderr, "gemm_amx_panels: built without AMX tiles (check gemm_amx_built)\n");
    abort();
#endif
}

/* One TDPBF16PS through the same macros, for the tests: C (rows x cols float32,
 * row-major) += A (rows x pairs bf16 pairs) . B (pairs x cols bf16 pairs), into
 * `out`. Tiles 0 (C), 1 (A), 2 (B) configured to exactly these shapes. Returns
 * 0, or -1 for a shape outside 1..16, or -2 where the tiles can't run. */
int gemm_amx_tile_dp(const float *c, const uint16_t *a, const uint16_t *b, float *out, int rows, int pairs,
                     int cols) {
    if (rows < 1 || rows > TR || pairs < 1 || pairs > TK || cols < 1 || cols > 16) return -1;
#ifdef HAVE_TILES
#ifdef AMX_REAL
    if (!gemm_amx_ready()) return -2;
#endif
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = (uint8_t)rows, cfg.colsb[0] = (uint16_t)(4 * cols);
    cfg.rows[1] = (uint8_t)rows, cfg.colsb[1] = (uint16_t)(4 * pairs);
    cfg.rows[2] = (uint8_t)pairs, cfg.colsb[2] = (uint16_t)(4 * cols);
    TILE_CONFIG(&cfg);
    TILE_LOAD(0, c, 4 * cols);
    TILE_LOAD(1, a, 4 * pairs);
    TILE_LOAD(2, b, 4 * cols);
    TILE_DP(0, 1, 2);
    TILE_STORE(0, out, 4 * cols);
    TILE_RELEASE();
    return 0;
#else
    (void)c, (void)a, (void)b, (void)out;
    return -2;
#endif
}
