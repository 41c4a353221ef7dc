// Ragged prefill attention over the paged KV cache on tensor cores (sm_80 and later): the
// contract and arguments of paged_attention_prefill (prefill_attention.cu), for __half and
// __nv_bfloat16. Not wired into ops / instances yet: it runs under the emulator in
// tests/kernels/test_prefill_attention_tc.py and has not been timed on a GPU.
//
// One CTA of 4 warps per (tile of 64 query tokens, head, sequence); each warp owns 16 query
// rows. The CTA stages its Q tile once and then walks the keys 0..(its last query's position)
// in tiles of kKeys tokens, copied from the paged cache with cp.async (a key's block comes from
// the block table, so a tile may span several KV blocks; positions past the last query are
// zero-filled, never read). Per key tile and warp: S = Q K^T with mma.m16n8k16 (Q rows and K
// rows through ldmatrix), causal mask and online softmax on the S fragments (a row lives in
// the 4 lanes of one lane group), then O += P V with P taken straight from the S registers as
// the A fragment and V through ldmatrix.trans. Single-buffered: overlapping the next tile's
// copy with this tile's math is the next step.

#include "common.cuh"
#include "tensor_core.cuh"

namespace noria {
namespace prefill_tc {
constexpr int kWarps = 4;
constexpr int kNumThreads = 32 * kWarps;
constexpr int kTileQ = 16 * kWarps;  // query rows per CTA
constexpr int kMaxStaticSmem = 48 * 1024;

// Static shared memory: the Q tile and one K and one V tile of `keys` tokens, 16-bit
// elements, rows of head_dim + pad elements.
constexpr int smem_bytes(int head_dim, int keys, int pad) {
  return 2 * (kTileQ + 2 * keys) * (head_dim + pad);
}
constexpr int key_tile(int head_dim) { return smem_bytes(head_dim, 32, 0) <= kMaxStaticSmem ? 32 : 16; }
// 8 extra elements (16 bytes) per row where they fit: the 8 rows an ldmatrix reads then start
// in different banks.
constexpr int row_pad(int head_dim) {
  return smem_bytes(head_dim, key_tile(head_dim), 8) <= kMaxStaticSmem ? 8 : 0;
}

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  return pack_bf16x2(lo, hi);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  return pack_f16x2(lo, hi);
}
}  // namespace prefill_tc
}  // namespace noria

// out:             [num_tokens, num_heads, HEAD_DIM]
// query:           token t, head h at query + t * q_stride + h * HEAD_DIM (16-byte aligned rows)
// k/v_cache:       [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
// block_tables:    [num_seqs, bt_stride]; seq_lens: [num_seqs] context after this step
// query_start_loc: [num_seqs + 1]
// Grid: (ceil(max_query_len / 64), num_heads, num_seqs); 128 threads.
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(128) paged_attention_prefill_tc(
    T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_kv_heads, int q_stride, int bt_stride) {
  using namespace noria;
  using namespace noria::prefill_tc;
  static_assert(HEAD_DIM % 16 == 0, "head size in whole mma k-steps");
  static_assert(sizeof(T) == 2, "tensor cores take 16-bit inputs here");
  constexpr int kKeys = key_tile(HEAD_DIM);
  constexpr int kStride = HEAD_DIM + row_pad(HEAD_DIM);
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-wide column tiles of O
  constexpr int kKTiles = kKeys / 8;     // 8-key column tiles of S
  static_assert(smem_bytes(HEAD_DIM, kKeys, row_pad(HEAD_DIM)) <= kMaxStaticSmem, "smem");

  __shared__ __align__(16) T q_s[kTileQ * kStride];
  __shared__ __align__(16) T k_s[kKeys * kStride];
  __shared__ __align__(16) T v_s[kKeys * kStride];

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
  const int* table = block_tables + static_cast<long long>(seq) * bt_stride;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // lane group (fragment row) and lane in the group
  const int row0 = warp * 16;            // this warp's first row in the tile
  const bool warp_active = row0 < rows;  // uniform for the warp
  const int warp_last_pos = prefix + tile_begin + min(row0 + 15, rows - 1);
  const int qpos = prefix + tile_begin + row0 + g;  // row g; row g + 8 is qpos + 8

  for (int idx = threadIdx.x; idx < kTileQ * kChunks; idx += kNumThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < rows;
    const T* src =
        ok ? query + static_cast<long long>(q_begin + tile_begin + r) * q_stride + head * HEAD_DIM + c * 8
           : query;
    cp_async_16_zfill(&q_s[r * kStride + c * 8], src, ok ? 16 : 0);
  }
  cp_async_commit();

  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};  // running max of rows g and g + 8
  float l[2] = {0.0f, 0.0f};            // this lane's share of their running sums

  for (int kv0 = 0; kv0 <= last_pos; kv0 += kKeys) {
    __syncthreads();  // every warp is done with the previous K/V tile
    for (int idx = threadIdx.x; idx < kKeys * kChunks; idx += kNumThreads) {
      const int j = idx / kChunks, c = idx % kChunks;
      const int pos = kv0 + j;
      const bool ok = pos <= last_pos;
      long long off = 0;
      if (ok) {
        const long long phys = table[pos / BLOCK_SIZE];
        off = ((phys * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
      }
      cp_async_16_zfill(&k_s[j * kStride + c * 8], k_cache + off, ok ? 16 : 0);
      cp_async_16_zfill(&v_s[j * kStride + c * 8], v_cache + off, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();  // this thread's Q (first time) and K/V copies
    __syncthreads();     // everyone's
    if (!warp_active || kv0 > warp_last_pos) continue;  // warp-uniform: all keys masked

    // S = Q K^T for the warp's 16 rows and the tile's kKeys keys.
    float s[kKTiles][4];
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      unsigned qa[4];
      ldmatrix_x4(qa, &q_s[(row0 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8]);
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt) {
        unsigned kb[2];  // K rows are B's columns: no transpose
        ldmatrix_x2(kb, &k_s[(nt * 8 + lane % 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8]);
        mma_m16n8k16<T>(s[nt], qa, kb, s[nt]);
      }
    }

    // Causal mask and online softmax; s[nt][i] is row g + 8 (i / 2), key 8 nt + 2t + i % 2.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kpos = kv0 + nt * 8 + 2 * t + (i & 1);
        float v = s[nt][i] * scale;
        if (kpos > qpos + 8 * (i >> 1)) v = neg_inf();
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

  if (!warp_active) return;  // after the last barrier
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= rows) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    T* dst = out + (static_cast<long long>(q_begin + tile_begin + row) * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      dst[dt * 8 + 2 * t] = from_float<T>(o[dt][2 * r] * inv);
      dst[dt * 8 + 2 * t + 1] = from_float<T>(o[dt][2 * r + 1] * inv);
    }
  }
}
