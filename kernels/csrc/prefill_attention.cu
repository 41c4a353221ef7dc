// Ragged prefill attention over the paged KV cache. The query tokens of all sequences are
// flattened (query_start_loc); the K/V of every token, cached prefix and new tokens alike,
// are already in the cache (reshape_and_cache runs first). Query i of sequence s sits at
// position seq_lens[s] - q_len + i and attends causally to positions 0..that position, which
// covers chunked prefill and prefix-cache hits with no special case. With a sliding window
// (window > 0) the query at position p sees positions p - window + 1 .. p only: the key loop
// starts at the tile that holds the first key the CTA's first query sees, so a long sequence
// costs its window, and keys before that are never loaded. Soft-capping (soft_cap > 0): every
// score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2).
//
// One CTA per (tile of 16 query tokens, head, sequence). The keys are walked in tiles of
// kKeyTile tokens (a whole KV block, or a slice of one: large blocks and head sizes would not
// fit in 48 KB of static shared memory), each staged in shared memory as float; a row of the
// query tile is served by 8 threads that split the key tile's keys for Q.K and the head
// dimension for P.V, with an online softmax per row.

#include "common.cuh"

namespace noria {
namespace prefill {
constexpr int kNumThreads = 128;
constexpr int kTileQ = 16;                          // query rows per CTA
constexpr int kRowThreads = kNumThreads / kTileQ;   // threads per row, within one warp
constexpr int kMaxStaticSmem = 48 * 1024;            // more needs an opt-in at launch

// Static shared memory of one CTA for a key tile of `keys` tokens (q_s, k_s, v_s, p_s).
constexpr int smem_bytes(int head_dim, int keys) {
  return 4 * (kTileQ * (head_dim + 1) + keys * (head_dim + 1) + keys * head_dim + kTileQ * keys);
}

// Keys staged per step: the largest of 32, 16, 8 that divides the block size (a tile never
// straddles two blocks) and fits in static shared memory.
constexpr int key_tile(int head_dim, int block_size) {
  return (block_size % 32 == 0 && smem_bytes(head_dim, 32) <= kMaxStaticSmem)   ? 32
         : (block_size % 16 == 0 && smem_bytes(head_dim, 16) <= kMaxStaticSmem) ? 16
                                                                                 : 8;
}

// Occupancy hint for __launch_bounds__: 0 leaves ptxas its default register budget. With
// 8-key tiles ptxas' default budget for sm_80 is tight enough to spill (48 registers for
// 16-bit head size 32); 1 CTA per SM lets it take what it needs (about 64).
constexpr int min_ctas_per_sm(int head_dim, int block_size) {
  return key_tile(head_dim, block_size) == 8 ? 1 : 0;
}
}  // namespace prefill
}  // namespace noria

// out:             [num_tokens, num_heads, HEAD_DIM]
// query:           token t, head h at query + t * q_stride + h * HEAD_DIM
// k/v_cache:       [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
// block_tables:    [num_seqs, bt_stride]; seq_lens: [num_seqs] context after this step
// query_start_loc: [num_seqs + 1]
// window:          keys a query sees (itself included), 0 = every position up to its own
// soft_cap:        logit soft-capping, 0 = off
// Grid: (ceil(max_query_len / 16), num_heads, num_seqs).
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(128, noria::prefill::min_ctas_per_sm(HEAD_DIM, BLOCK_SIZE))
    paged_attention_prefill(
    T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_kv_heads, int q_stride, int bt_stride, int window, float soft_cap) {
  using namespace noria;
  using namespace noria::prefill;
  constexpr int kVec = Vec16<T>::kElems;
  constexpr int kChunks = HEAD_DIM / kVec;
  constexpr int kKeyTile = key_tile(HEAD_DIM, BLOCK_SIZE);
  constexpr int kKeysPerThread = kKeyTile / kRowThreads;
  constexpr int kDimsPerThread = HEAD_DIM / kRowThreads;
  constexpr int kPad = HEAD_DIM + 1;  // odd row stride: 8 rows read in parallel hit 8 banks
  static_assert(kKeyTile % kRowThreads == 0 && HEAD_DIM % kRowThreads == 0, "even split");
  static_assert(BLOCK_SIZE % kKeyTile == 0, "a key tile must not straddle blocks");
  static_assert(smem_bytes(HEAD_DIM, kKeyTile) <= kMaxStaticSmem, "static shared memory");
  static_assert(kWarpSize % kRowThreads == 0, "a row's threads must share a warp");

  const int tile = blockIdx.x, head = blockIdx.y, seq = blockIdx.z;
  const int num_heads = gridDim.y;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int tile_begin = tile * kTileQ;
  if (tile_begin >= q_len) return;  // uniform for the CTA, before any barrier
  const int kv_head = head / (num_heads / num_kv_heads);
  const int ctx = seq_lens[seq];
  const int prefix = ctx - q_len;
  const int rows = min(kTileQ, q_len - tile_begin);
  const int last_pos = prefix + tile_begin + rows - 1;
  const int num_tiles = last_pos / kKeyTile + 1;
  // The first key the tile's first query sees: every later row's window starts later.
  const int lo = window > 0 ? max(0, prefix + tile_begin - window + 1) : 0;
  const int first_tile = lo / kKeyTile;

  __shared__ float q_s[kTileQ][kPad];
  __shared__ float k_s[kKeyTile][kPad];
  __shared__ float v_s[kKeyTile][HEAD_DIM];
  __shared__ float p_s[kTileQ][kKeyTile];

  for (int idx = threadIdx.x; idx < kTileQ * HEAD_DIM; idx += kNumThreads) {
    const int r = idx / HEAD_DIM, d = idx % HEAD_DIM;
    const long long token = q_begin + tile_begin + r;
    q_s[r][d] = r < rows ? to_float(query[token * q_stride + head * HEAD_DIM + d]) * scale : 0.0f;
  }

  const int r = threadIdx.x / kRowThreads;  // this thread's query row
  const int rl = threadIdx.x % kRowThreads; // its rank among the row's threads
  const bool row_valid = r < rows;
  const int qpos = row_valid ? prefix + tile_begin + r : -1;  // -1 masks every key
  float m = neg_inf(), l = 0.0f;
  const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;  // no division per score
  float acc[kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) acc[i] = 0.0f;

  const int* table = block_tables + static_cast<long long>(seq) * bt_stride;
  for (int kt = first_tile; kt < num_tiles; ++kt) {
    __syncthreads();  // the previous tile's k_s/v_s/p_s readers are done (and q_s is ready)
    const int base = kt * kKeyTile;  // position of the tile's first key
    const long long phys = table[base / BLOCK_SIZE];
    const int in_block = base % BLOCK_SIZE;
    for (int idx = threadIdx.x; idx < kKeyTile * kChunks; idx += kNumThreads) {
      const int j = idx / kChunks, c = idx % kChunks;
      float k[kVec], v[kVec];
      if (base + j < ctx && base + j >= lo) {
        const long long off =
            ((phys * BLOCK_SIZE + in_block + j) * num_kv_heads + kv_head) * HEAD_DIM + c * kVec;
        load16_as_float(k_cache + off, k);
        load16_as_float(v_cache + off, v);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) k[i] = v[i] = 0.0f;  // past the context or before the window
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        k_s[j][c * kVec + i] = k[i];
        v_s[j][c * kVec + i] = v[i];
      }
    }
    __syncthreads();

    // This thread's keys are rl, rl + 8, ...: 8 threads read 8 different rows of k_s.
    float s[kKeysPerThread];
#pragma unroll
    for (int t = 0; t < kKeysPerThread; ++t) s[t] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; ++d) {
      const float qd = q_s[r][d];
#pragma unroll
      for (int t = 0; t < kKeysPerThread; ++t) s[t] += qd * k_s[rl + t * kRowThreads][d];
    }
    float bmax = neg_inf();
#pragma unroll
    for (int t = 0; t < kKeysPerThread; ++t) {
      const int kpos = base + rl + t * kRowThreads;
      if (soft_cap > 0.0f) s[t] = soft_cap * tanhf(s[t] * inv_cap);
      if (kpos > qpos) s[t] = neg_inf();  // causal mask
      if (window > 0 && kpos <= qpos - window) s[t] = neg_inf();  // sliding window
      bmax = fmaxf(bmax, s[t]);
    }
#pragma unroll
    for (int offset = kRowThreads / 2; offset > 0; offset >>= 1)
      bmax = fmaxf(bmax, __shfl_xor_sync(kFullMask, bmax, offset));
    const float m_new = fmaxf(m, bmax);
    // A row may see no unmasked key in this tile (or at all, for rows past the tile).
    const float shrink = m_new == neg_inf() ? 1.0f : __expf(m - m_new);
    float psum = 0.0f;
#pragma unroll
    for (int t = 0; t < kKeysPerThread; ++t) {
      const float p = s[t] == neg_inf() ? 0.0f : __expf(s[t] - m_new);
      p_s[r][rl + t * kRowThreads] = p;
      psum += p;
    }
#pragma unroll
    for (int offset = kRowThreads / 2; offset > 0; offset >>= 1)
      psum += __shfl_xor_sync(kFullMask, psum, offset);
    l = l * shrink + psum;
    m = m_new;
    __syncwarp();  // p_s[r][*] is written by the row's threads, all in this warp

#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) acc[i] *= shrink;
#pragma unroll 2
    for (int j = 0; j < kKeyTile; ++j) {
      const float p = p_s[r][j];
#pragma unroll
      for (int i = 0; i < kDimsPerThread; ++i) acc[i] += p * v_s[j][rl + i * kRowThreads];
    }
  }

  if (row_valid) {
    const long long token = q_begin + tile_begin + r;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) {
      const int d = rl + i * kRowThreads;
      out[(token * num_heads + head) * HEAD_DIM + d] = from_float<T>(acc[i] * inv);
    }
  }
}
