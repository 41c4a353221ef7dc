// Ragged prefill attention over the paged KV cache on tensor cores (sm_80 and later), the
// FlashAttention-2 structure for __half and __nv_bfloat16: the contract of
// paged_attention_prefill (prefill_attention.cu) -- query i of sequence s sits at position
// seq_lens[s] - q_len + i and attends causally to every cached position up to its own, which
// covers whole prompts, chunked prefill and prefix-cache hits alike.
//
// Work: one CTA of 4 warps per (work item, KV head). A work item is (sequence, query tile),
// listed by the host over the sequences that have prefill rows only, so the grid is the total
// number of tiles, not ceil(max_q / tile) x heads x sequences. GQA packing: the G = num_heads /
// num_kv_heads query heads that share a KV head are interleaved along M -- packed row p of a
// sequence is its query token p / G under head kv_head * G + p % G -- so one K/V tile feeds
// all G heads and a short chunk still fills the 64 rows of a tile. Each warp owns 16 rows.
//
// Per CTA: the Q tile is copied to shared memory once and each warp keeps its 16 rows as mma A
// fragments in registers. The keys 0..(the tile's last query position) are walked in tiles of
// kKeys tokens gathered from the paged cache with cp.async (a key's block comes from the block
// table, so a tile may span several KV blocks; rows past the last query position are
// zero-filled, never read), double-buffered: tile j + 1 is in flight while tile j is computed.
// Per key tile and warp: S = Q K^T with mma.m16n8k16 (K rows through ldmatrix), causal mask and
// online softmax on the S fragments (a row lives in the 4 lanes of one lane group), then
// O += P V with P taken straight from the S registers as the A fragment and V through
// ldmatrix.trans. A warp skips the tiles wholly after its last row's position (causal).
//
// Sliding window (window > 0): the query at position p sees positions p - window + 1 .. p.
// The key walk starts at the tile holding the first key the CTA's first row sees (a long
// sequence costs its window, not its length), keys before that key are zero-filled instead of
// read, and a warp also skips the tiles wholly before its own first row's window.
// Soft-capping (soft_cap > 0): every score s = scale * q.k becomes soft_cap * tanh(s / soft_cap)
// before the softmax (Gemma 2).
//
// fp8 KV cache (C = noria::fp8_e4m3): each K/V row chunk of 8 bytes is loaded, widened to T
// (exact) and stored to the same shared tile the 16-bit cache's cp.async fills, so the mma
// path is unchanged; the K scale folds into the softmax scale, the V scale into the output.

#include "common.cuh"
#include "fp8.cuh"
#include "tensor_core.cuh"

namespace noria {
namespace prefill_tc {
constexpr int kWarps = 4;
constexpr int kNumThreads = 32 * kWarps;
constexpr int kTileQ = 16 * kWarps;  // packed query rows per CTA
constexpr int kStages = 2;           // K/V tiles in shared memory: one computed, one in flight
constexpr int kMaxStaticSmem = 48 * 1024;

// Shared memory rows: kStages x (K tile, V tile) of `keys` rows each. The Q tile passes
// through the same rows first (its fragments then live in registers).
constexpr int smem_rows(int keys) {
  return kStages * 2 * keys > kTileQ ? kStages * 2 * keys : kTileQ;
}
// Static shared memory in bytes: 16-bit elements, rows of head_dim + pad elements.
constexpr int smem_bytes(int head_dim, int keys, int pad) {
  return 2 * smem_rows(keys) * (head_dim + pad);
}
// 32 keys per tile where two stages fit, else 16 (one mma k-step of P V).
constexpr int key_tile(int head_dim) { return smem_bytes(head_dim, 32, 0) <= kMaxStaticSmem ? 32 : 16; }
// 8 extra elements (16 bytes) per row where they fit: the 8 rows an ldmatrix reads then start
// in different banks.
constexpr int row_pad(int head_dim) {
  return smem_bytes(head_dim, key_tile(head_dim), 8) <= kMaxStaticSmem ? 8 : 0;
}

// Issues (does not commit) the cp.async copies of the K and V rows of positions
// kv0 .. kv0 + KEYS - 1 of one KV head into k_s / v_s; positions before first_pos or past
// last_pos are zero-filled. An fp8 cache's rows are widened and stored right away instead.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int KEYS, int STRIDE, typename C>
__device__ __forceinline__ void load_kv_tile(T* k_s, T* v_s, const C* k_cache, const C* v_cache,
                                             const int* table, int kv0, int first_pos,
                                             int last_pos, int num_kv_heads, int kv_head) {
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < KEYS * kChunks; idx += kNumThreads) {
    const int j = idx / kChunks, c = idx % kChunks;
    const int pos = kv0 + j;
    const bool ok = pos >= first_pos && pos <= last_pos;
    long long off = 0;
    if (ok) {
      const long long phys = table[pos / BLOCK_SIZE];
      off = ((phys * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
    }
    if constexpr (IsFp8<C>::value) {
      fp8x8_to_smem(&k_s[j * STRIDE + c * 8], k_cache + off, ok);
      fp8x8_to_smem(&v_s[j * STRIDE + c * 8], v_cache + off, ok);
    } else {
      cp_async_16_zfill(&k_s[j * STRIDE + c * 8], k_cache + off, ok ? 16 : 0);
      cp_async_16_zfill(&v_s[j * STRIDE + c * 8], v_cache + off, ok ? 16 : 0);
    }
  }
}
}  // namespace prefill_tc
}  // namespace noria

// out:             [num_tokens, num_heads, HEAD_DIM]
// query:           token t, head h at query + t * q_stride + h * HEAD_DIM (16-byte aligned rows)
// k/v_cache:       [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] of C: T, or fp8_e4m3 bytes
//                  that read as fp8 * k_scale / v_scale (other caches: both scales 1)
// block_tables:    [num_seqs, bt_stride]; seq_lens: [num_seqs] context after this step
// query_start_loc: [num_seqs + 1]
// work:            [num_items, 2] (sequence, tile of 64 packed rows); every tile of a sequence
//                  that is listed must be listed (ops.prefill_work_items)
// window:          keys a query sees (itself included), 0 = every position up to its own
// soft_cap:        logit soft-capping, 0 = off
// Grid: (num_items, num_kv_heads); 128 threads.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, typename C = T>
__global__ void __launch_bounds__(128, 1) paged_attention_prefill_tc(
    T* __restrict__ out, const T* __restrict__ query, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ work, float scale, int num_heads, int q_stride, int bt_stride,
    int window, float soft_cap, float k_scale, float v_scale) {
  using namespace noria;
  using namespace noria::prefill_tc;
  static_assert(HEAD_DIM % 16 == 0, "head size in whole mma k-steps");
  static_assert(sizeof(T) == 2, "tensor cores take 16-bit inputs here");
  constexpr int kKeys = key_tile(HEAD_DIM);
  constexpr int kStride = HEAD_DIM + row_pad(HEAD_DIM);
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int kKSteps = HEAD_DIM / 16; // mma k-steps of Q K^T
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-wide column tiles of O
  constexpr int kKTiles = kKeys / 8;     // 8-key column tiles of S
  static_assert(kKeys % 16 == 0, "P V takes whole 16-key steps");
  static_assert(smem_bytes(HEAD_DIM, kKeys, row_pad(HEAD_DIM)) <= kMaxStaticSmem, "smem");
  scale *= k_scale;  // q . (fp8 * k_scale) = k_scale * (q . fp8)

  __shared__ __align__(16) T smem[smem_rows(kKeys) * kStride];

  const int seq = work[2 * blockIdx.x], tile = work[2 * blockIdx.x + 1];
  const int kv_head = blockIdx.y;
  const int num_kv_heads = gridDim.y;
  const int group = num_heads / num_kv_heads;  // query heads per KV head, packed along M
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int packed = q_len * group;  // packed rows of the sequence
  const int tile_begin = tile * kTileQ;
  if (tile_begin >= packed) return;  // uniform for the CTA, before any barrier
  const int prefix = seq_lens[seq] - q_len;
  const int rows = min(kTileQ, packed - tile_begin);
  const int last_pos = prefix + (tile_begin + rows - 1) / group;
  // The first key the tile's first row sees (every later row's window starts later) and the
  // first key tile the CTA walks.
  const int first_pos = window > 0 ? max(0, prefix + tile_begin / group - window + 1) : 0;
  const int first_tile = first_pos / kKeys;
  const int kv_begin = first_tile * kKeys;
  const int* table = block_tables + static_cast<long long>(seq) * bt_stride;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // lane group (fragment row) and lane in the group
  const int row0 = warp * 16;            // this warp's first row in the tile
  const bool warp_active = row0 < rows;  // uniform for the warp
  const int warp_last_pos = prefix + (tile_begin + min(row0 + 15, rows - 1)) / group;
  // Keys before this one are outside the window of every row of the warp (no bound: 0).
  const int warp_first_pos = window > 0 ? prefix + (tile_begin + row0) / group - window + 1 : 0;
  int qpos[2];  // positions of rows g and g + 8; -1 (every key masked) past the sequence
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int p = tile_begin + row0 + g + 8 * r;
    qpos[r] = p < packed ? prefix + p / group : -1;
  }

  // Q tile -> shared memory -> A fragments in registers. Tile j of K/V goes to stage j % 2
  // (K at rows [2 s kKeys, (2 s + 1) kKeys), V right after). Where stage 1 alone holds the Q
  // tile (32-key tiles), Q is staged there and tile 0's copy into stage 0 overlaps it.
  constexpr bool kQInStage1 = 2 * kKeys >= kTileQ;
  T* q_s = smem + (kQInStage1 ? 2 * kKeys * kStride : 0);
  for (int idx = threadIdx.x; idx < kTileQ * kChunks; idx += kNumThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int p = tile_begin + r;
    const bool ok = r < rows;
    const long long token = q_begin + p / group;
    const int head = kv_head * group + p % group;
    const T* src = ok ? query + token * q_stride + head * HEAD_DIM + c * 8 : query;
    cp_async_16_zfill(&q_s[r * kStride + c * 8], src, ok ? 16 : 0);
  }
  cp_async_commit();
  if (kQInStage1) {
    load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, kKeys, kStride, C>(
        smem, smem + kKeys * kStride, k_cache, v_cache, table, kv_begin, first_pos, last_pos,
        num_kv_heads, kv_head);
    cp_async_commit();
    cp_async_wait<1>();  // Q has landed; tile 0 may still be in flight
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  unsigned qa[kKSteps][4];
  if (warp_active) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      ldmatrix_x4(qa[kk], &q_s[(row0 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8]);
  }
  __syncthreads();  // every warp holds its Q before K/V copies overwrite those rows

  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};  // running max of rows g and g + 8
  float l[2] = {0.0f, 0.0f};            // this lane's share of their running sums
  const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;  // no division per score

  const int num_tiles = last_pos / kKeys + 1 - first_tile;  // through the diagonal
  if (!kQInStage1) {
    load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, kKeys, kStride, C>(
        smem, smem + kKeys * kStride, k_cache, v_cache, table, kv_begin, first_pos, last_pos,
        num_kv_heads, kv_head);
    cp_async_commit();
  }
  for (int j = 0; j < num_tiles; ++j) {
    const int kv0 = kv_begin + j * kKeys;
    if (j + 1 < num_tiles) {  // prefetch the next tile into the other stage
      T* next = smem + ((j + 1) % kStages) * 2 * kKeys * kStride;
      load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, kKeys, kStride, C>(
          next, next + kKeys * kStride, k_cache, v_cache, table, kv0 + kKeys, first_pos,
          last_pos, num_kv_heads, kv_head);
    }
    cp_async_commit();   // possibly empty: the wait below always leaves exactly one group
    cp_async_wait<1>();  // this thread's copies of tile j have landed
    __syncthreads();     // and everyone's
    const T* k_s = smem + (j % kStages) * 2 * kKeys * kStride;
    const T* v_s = k_s + kKeys * kStride;

    // Warp-uniform: else every key of the tile is masked for the warp's rows.
    if (warp_active && kv0 <= warp_last_pos && kv0 + kKeys > warp_first_pos) {
      // S = Q K^T for the warp's 16 rows and the tile's kKeys keys.
      float s[kKTiles][4];
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
        for (int nt = 0; nt < kKTiles; ++nt) {
          unsigned kb[2];  // K rows are B's columns: no transpose
          ldmatrix_x2(kb, &k_s[(nt * 8 + lane % 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8]);
          mma_m16n8k16<T>(s[nt], qa[kk], kb, s[nt]);
        }
      }

      // Soft-cap, causal and window masks, online softmax; s[nt][i] is row g + 8 (i / 2), key
      // 8 nt + 2t + i % 2.
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int kpos = kv0 + nt * 8 + 2 * t + (i & 1);
          float v = s[nt][i] * scale;
          if (soft_cap > 0.0f) v = soft_cap * tanhf(v * inv_cap);
          if (kpos > qpos[i >> 1]) v = neg_inf();
          if (window > 0 && kpos <= qpos[i >> 1] - window) v = neg_inf();
          s[nt][i] = v;
          mx[i >> 1] = fmaxf(mx[i >> 1], v);
        }
      float corr[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
        base[r] = mx[r] == neg_inf() ? 0.0f : mx[r];  // a row with nothing visible yet
        corr[r] = __expf(m[r] - base[r]);
        m[r] = mx[r];
      }
      float part[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float p = __expf(s[nt][i] - base[i >> 1]);
          s[nt][i] = p;
          part[i >> 1] += p;
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + part[r];
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[dt][0] *= corr[0];
        o[dt][1] *= corr[0];
        o[dt][2] *= corr[1];
        o[dt][3] *= corr[1];
      }

      // O += P V: P's C fragments of two 8-key tiles are the A fragment of one 16-key step.
#pragma unroll
      for (int kc = 0; kc < kKeys / 16; ++kc) {
        unsigned pa[4];
        pa[0] = pack2<T>(s[2 * kc][0], s[2 * kc][1]);
        pa[1] = pack2<T>(s[2 * kc][2], s[2 * kc][3]);
        pa[2] = pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[3] = pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          unsigned vb[2];  // V rows are B's rows: transpose into column pairs
          ldmatrix_x2_trans(vb, &v_s[(kc * 16 + lane % 16) * kStride + dt * 8]);
          mma_m16n8k16<T>(o[dt], pa, vb, o[dt]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before tile j + 2 is copied into it
  }

  if (!warp_active) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int p = tile_begin + row0 + g + 8 * r;
    if (p >= packed) continue;
    const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
    const long long token = q_begin + p / group;
    const int head = kv_head * group + p % group;
    T* dst = out + (token * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)  // the two adjacent columns as one 4-byte store
      *reinterpret_cast<unsigned*>(&dst[dt * 8 + 2 * t]) = pack2<T>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
  }
}
