// Paged attention for decode: one query token per sequence, keys and values read through the
// block table. One CTA per (query head, sequence, partition). With one partition the CTA
// writes the output; with several (split-K, for long contexts) each CTA writes a normalised
// partial result plus its max logit and exp-sum, and paged_attention_reduce merges them.
//
// Sliding window (window > 0): the query at position ctx - 1 sees positions ctx - window ..
// ctx - 1 only. Partitions start at the block that holds the window's first key, so blocks
// wholly before the window are never visited (a long context costs its window); keys of
// that block before the window are never loaded. Soft-capping (soft_cap > 0): every score
// s = scale * q.k becomes soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2).
//
// Inside a CTA, warp w takes the partition's KV blocks w, w + 4, ...; within a warp, groups of
// 8 lanes each own one token at a time and split its head_dim into 16-byte chunks, so a
// group reads 128 contiguous bytes per load. Every group keeps its own online-softmax state
// (max, sum, weighted V); at the end the 16 groups are merged through shared memory.

#include "common.cuh"

namespace noria {
namespace decode {
constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * kWarpSize;
constexpr int kGroup = 8;                               // lanes per token
constexpr int kTokensPerStep = kWarpSize / kGroup;      // tokens a warp handles at once
constexpr int kGroups = kNumWarps * kTokensPerStep;      // independent softmax states per CTA
// Occupancy hint for __launch_bounds__: 0 leaves ptxas its default register budget. That
// budget spills on sm_90 for float rows of 256 (64 q/acc registers per lane; capped at 96)
// and for float rows of 96 in 8-token blocks (the token loop unrolls fully); 1 CTA per SM
// lifts the cap (rows of 256 then take about 120 registers, still 4 CTAs per SM).
constexpr int min_ctas_per_sm(int head_dim, int block_size) {
  return head_dim > 128 || block_size < 16 ? 1 : 0;
}
}  // namespace decode
}  // namespace noria

// out:          [num_seqs, num_heads, HEAD_DIM]               (single partition)
// part_out:     [num_seqs, num_heads, max_parts, HEAD_DIM]    (split-K; float, normalised)
// part_max/sum: [num_seqs, num_heads, max_parts]
// query:        token s, head h at query + s * q_stride + h * HEAD_DIM
// k/v_cache:    [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
// block_tables: [num_seqs, bt_stride] physical block ids; seq_lens: [num_seqs] context length
// partition_size: tokens per partition, a multiple of BLOCK_SIZE (>= max context when the
//                 grid has one partition); with a window, partitions count from the block
//                 that holds the window's first key
// window:         keys a query sees (itself included), 0 = the whole context
// soft_cap:       logit soft-capping, 0 = off
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(128, noria::decode::min_ctas_per_sm(HEAD_DIM, BLOCK_SIZE))
    paged_attention_decode(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, const T* __restrict__ query, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, float scale, int num_kv_heads, int q_stride,
    int bt_stride, int partition_size, int window, float soft_cap) {
  using namespace noria;
  using namespace noria::decode;
  constexpr int kVec = Vec16<T>::kElems;
  constexpr int kChunks = HEAD_DIM / kVec;                      // 16-byte chunks per row
  constexpr int kChunksPerLane = (kChunks + kGroup - 1) / kGroup;
  static_assert(HEAD_DIM % kVec == 0, "rows must be whole 16-byte chunks");
  static_assert(BLOCK_SIZE % kTokensPerStep == 0, "a warp step must not straddle blocks");

  const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x, num_parts = gridDim.z;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int ctx = seq_lens[seq];
  const int lo = window > 0 ? max(0, ctx - window) : 0;  // the first key the query sees
  const int start = lo / BLOCK_SIZE * BLOCK_SIZE + part * partition_size;
  // Uniform for the CTA and before any barrier: the reduce kernel ignores this partition.
  if (num_parts > 1 && start >= ctx) return;
  const int end = min(ctx, start + partition_size);

  __shared__ float q_s[HEAD_DIM];
  __shared__ float grp_m[kGroups];
  __shared__ float grp_l[kGroups];
  __shared__ float grp_acc[kGroups][HEAD_DIM];

  const T* q = query + static_cast<long long>(seq) * q_stride + head * HEAD_DIM;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) q_s[d] = to_float(q[d]) * scale;
  __syncthreads();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int glane = lane % kGroup;  // lane within the group: which chunks it owns
  const int group = lane / kGroup;  // which token of the warp step it works on

  float qr[kChunksPerLane][kVec];
  float acc[kChunksPerLane][kVec];
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c) {
    const int chunk = glane + c * kGroup;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      qr[c][i] = chunk < kChunks ? q_s[chunk * kVec + i] : 0.0f;
      acc[c][i] = 0.0f;
    }
  }
  float m = neg_inf(), l = 0.0f;
  // One division, not one per score: a float division is a subroutine call on the GPU, and
  // ptxas spilled around it in this loop.
  const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;

  const int* table = block_tables + static_cast<long long>(seq) * bt_stride;
  const int first_block = start / BLOCK_SIZE;
  const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;
  for (int b = warp; b < num_blocks; b += kNumWarps) {
    const int logical_block = first_block + b;
    const long long phys = table[logical_block];
    // The loop bound is the same for every group, so the shuffles below see the full warp.
#pragma unroll 2
    for (int j = group; j < BLOCK_SIZE; j += kTokensPerStep) {
      const int pos = logical_block * BLOCK_SIZE + j;
      const bool valid = pos >= lo && pos < end;
      const long long row = ((phys * BLOCK_SIZE + j) * num_kv_heads + kv_head) * HEAD_DIM;
      float dot = 0.0f;
      if (valid) {
#pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
          const int chunk = glane + c * kGroup;
          if (chunk < kChunks) {
            float k[kVec];
            load16_as_float(k_cache + row + chunk * kVec, k);
#pragma unroll
            for (int i = 0; i < kVec; ++i) dot += qr[c][i] * k[i];
          }
        }
      }
#pragma unroll
      for (int offset = kGroup / 2; offset > 0; offset >>= 1)
        dot += __shfl_xor_sync(kFullMask, dot, offset);
      // Invalid slots are never loaded: the cache past the context may hold anything.
      if (valid) {
        if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot * inv_cap);
        if (dot > m) {
          const float shrink = __expf(m - dot);
          l *= shrink;
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c)
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[c][i] *= shrink;
          m = dot;
        }
        const float p = __expf(dot - m);
        l += p;
#pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
          const int chunk = glane + c * kGroup;
          if (chunk < kChunks) {
            float v[kVec];
            load16_as_float(v_cache + row + chunk * kVec, v);
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[c][i] += p * v[i];
          }
        }
      }
    }
  }

  // Publish each group's state; thread d then merges element d over all groups.
  const int gid = warp * kTokensPerStep + group;
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c) {
    const int chunk = glane + c * kGroup;
    if (chunk < kChunks)
#pragma unroll
      for (int i = 0; i < kVec; ++i) grp_acc[gid][chunk * kVec + i] = acc[c][i];
  }
  if (glane == 0) {
    grp_m[gid] = m;
    grp_l[gid] = l;
  }
  __syncthreads();

  // Thread t merges elements t, t + 128, ... (head sizes above 128 take two).
  constexpr int kMergePerThread = (HEAD_DIM + kNumThreads - 1) / kNumThreads;
#pragma unroll
  for (int i = 0; i < kMergePerThread; ++i) {
    const int d = threadIdx.x + i * kNumThreads;
    if (d >= HEAD_DIM) continue;
    float gm = neg_inf();
#pragma unroll
    for (int g = 0; g < kGroups; ++g) gm = fmaxf(gm, grp_m[g]);
    float total = 0.0f, o = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (grp_m[g] != neg_inf()) {  // a group that saw no token contributes nothing
        const float f = __expf(grp_m[g] - gm);
        total += grp_l[g] * f;
        o += grp_acc[g][d] * f;
      }
    }
    const float result = total > 0.0f ? o / total : 0.0f;  // empty context: zeros
    const long long sh = static_cast<long long>(seq) * num_heads + head;
    if (num_parts == 1) {
      out[sh * HEAD_DIM + d] = from_float<T>(result);
    } else {
      part_out[(sh * num_parts + part) * HEAD_DIM + d] = result;
      if (d == 0) {
        part_max[sh * num_parts + part] = gm;
        part_sum[sh * num_parts + part] = total;
      }
    }
  }
}

// Merges the split-K partials of one (head, sequence): weights each partition by its
// exp-sum rescaled to the global max. Grid (num_heads, num_seqs); dynamic shared memory
// holds one float per partition (max_parts = the partials' partition stride); block_size and
// window place the partitions where the decode kernel put them.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128) paged_attention_reduce(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ seq_lens, int max_parts,
    int partition_size, int block_size, int window) {
  using namespace noria;
  using namespace noria::decode;
  extern __shared__ __align__(16) unsigned char reduce_smem[];
  float* weight = reinterpret_cast<float*>(reduce_smem);
  __shared__ float scratch[kNumWarps];

  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
  const int ctx = seq_lens[seq];
  const int lo = window > 0 ? max(0, ctx - window) : 0;
  const int span = ctx - lo / block_size * block_size;  // from the first partition's start
  // max_parts bounds it in case the host sized the grid for a shorter context.
  const int parts = min(max_parts, (span + partition_size - 1) / partition_size);
  const long long sh = static_cast<long long>(seq) * num_heads + head;
  const float* pm = part_max + sh * max_parts;
  const float* ps = part_sum + sh * max_parts;

  float mx = neg_inf();
  for (int p = threadIdx.x; p < parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);
  mx = block_max<kNumWarps>(mx, scratch);

  float s = 0.0f;
  for (int p = threadIdx.x; p < parts; p += kNumThreads) {
    const float w = ps[p] * __expf(pm[p] - mx);
    weight[p] = w;
    s += w;
  }
  s = block_sum<kNumWarps>(s, scratch);  // its barriers also publish weight[]

  for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) {
    float o = 0.0f;
    for (int p = 0; p < parts; ++p) o += weight[p] * part_out[(sh * max_parts + p) * HEAD_DIM + d];
    out[sh * HEAD_DIM + d] = from_float<T>(s > 0.0f ? o / s : 0.0f);
  }
}
