// Paged attention for decode on tensor cores, sharing K/V across a GQA group (sm_80 and later,
// __half and __nv_bfloat16). The contract of paged_attention_decode (decode_attention.cu):
// one query token per sequence, keys and values read through the block table.
//
// Work: one CTA of 4 warps per (work item, KV head, group of up to 16 query heads). A work
// item is one partition of one sequence; the host lays the items out from a per-sequence
// partition count (a prefix sum, `part_start`), so a long sequence can be split while short
// ones in the same launch are not. A sequence with one partition writes `out`; one with
// several writes normalised float partials plus each row's max logit and exp-sum, merged by
// paged_attention_decode_gqa_merge.
//
// Why mma with the heads as M: the query heads of a group read the same K/V rows, so the CTA
// holds them as the 16 rows of an mma A operand (a group of 4 or 8 heads is zero-padded to 16)
// and every K/V byte is fetched from memory once per group instead of once per head. The
// padding costs only tensor-core cycles, which decode (memory-bound) has to spare; a CUDA-core
// loop over the heads with K/V in shared memory would save those cycles but spend issue slots
// on shared loads per head.
//
// Per key tile of kKeys tokens (a tile may span several KV blocks or be a slice of one):
//   1. S = Q K^T: warp w takes 8 keys (and, for 16-key tiles, half of head_dim), ldmatrix Q
//      and K from shared memory, mma.m16n8k16, S to shared memory;
//   2. online softmax: 8 threads per query row take the tile's max, rescale factor, P (rounded
//      to T, the mma input) and the running exp-sum;
//   3. O = corr * O + P V: warp w owns the 8-wide column tiles w, w + 4, ... of O, P through
//      ldmatrix and V through ldmatrix.trans.
// K/V tiles arrive by cp.async in a kStages-deep ring (zero-filled past the partition's end,
// so no slot past a context is read). The block-table entries of the tile after the one being
// issued are loaded right after that issue, so their latency hides behind a tile of math.
//
// Sliding window (window > 0): the query at position ctx - 1 sees positions ctx - window ..
// ctx - 1, one contiguous range, so the partitions simply start at its first key: nothing
// before the window is read or computed, and the host counts only the window as a sequence's
// work. Soft-capping (soft_cap > 0): every score s = scale * q.k becomes
// soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2).
//
// fp8 KV cache (C = noria::fp8_e4m3): each K/V row chunk of 8 bytes is loaded, widened to T
// (exact) and stored to the same shared tile the 16-bit cache's cp.async fills, so the mma
// path is unchanged; the K scale folds into the softmax scale, the V scale into the output.

#include "common.cuh"
#include "fp8.cuh"
#include "tensor_core.cuh"

namespace noria {
namespace decode_gqa {
constexpr int kWarps = 4;
constexpr int kNumThreads = kWarps * kWarpSize;
constexpr int kRows = 16;  // query heads per CTA: the mma's M
constexpr int kPad = 8;    // elements per shared row so that ldmatrix's 8 rows hit distinct banks
constexpr int kMaxStaticSmem = 48 * 1024;

// 32 keys per tile; 16 for head size 256, whose K/V tiles would not fit two stages otherwise.
constexpr int key_tile(int head_dim) { return head_dim > 128 ? 16 : 32; }
constexpr int dsplit(int head_dim) { return kWarps / (key_tile(head_dim) / 8); }

// Static shared memory: Q, the K/V ring, S (one slice per head_dim split), P, two row vectors.
constexpr int smem_bytes(int head_dim, int stages) {
  return 2 * (kRows + 2 * stages * key_tile(head_dim)) * (head_dim + kPad) +
         4 * dsplit(head_dim) * kRows * key_tile(head_dim) +
         2 * kRows * (key_tile(head_dim) + kPad) + 4 * 2 * kRows;
}
// As many stages (up to 4) as fit in 48 KB: 4 for head sizes up to 64, 3 for 80 and 96, 2
// for 128 and 256.
constexpr int num_stages(int head_dim) {
  return smem_bytes(head_dim, 4) <= kMaxStaticSmem   ? 4
         : smem_bytes(head_dim, 3) <= kMaxStaticSmem ? 3
                                                     : 2;
}
}  // namespace decode_gqa
}  // namespace noria

// out:          [num_seqs, num_heads, HEAD_DIM]            (sequences with one partition)
// part_out:     [num_items, num_heads, HEAD_DIM] float     (split sequences; normalised)
// part_max/sum: [num_items, num_heads]
// query:        sequence s, head h at query + s * q_stride + h * HEAD_DIM (16-byte aligned)
// k/v_cache:    [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] of C: T, or fp8_e4m3 bytes
//               that read as fp8 * k_scale / v_scale (other caches: both scales 1)
// block_tables: [num_seqs, bt_stride]; seq_lens: [num_seqs] context length
// work_seq:     [num_items] the sequence of each item; part_start: [num_seqs + 1] its first
//               item (an exclusive prefix sum of the partition counts, every count >= 1)
// chunk:        tokens per partition (a sequence's last partition takes the rest), counted
//               from the window's first key
// window:       keys a query sees (itself included), 0 = the whole context
// soft_cap:     logit soft-capping, 0 = off
// Grid: (num_items, num_kv_heads * ceil(group / 16)); 128 threads.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, typename C = T>
__global__ void __launch_bounds__(128) paged_attention_decode_gqa(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, const T* __restrict__ query, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ work_seq,
    const int* __restrict__ part_start, float scale, int num_heads, int num_kv_heads,
    int q_stride, int bt_stride, int chunk, int window, float soft_cap, float k_scale,
    float v_scale) {
  using namespace noria;
  using namespace noria::decode_gqa;
  static_assert(HEAD_DIM % 16 == 0, "head size in whole mma k-steps");
  static_assert(sizeof(T) == 2, "tensor cores take 16-bit inputs here");
  constexpr int kKeys = key_tile(HEAD_DIM);
  constexpr int kStages = num_stages(HEAD_DIM);
  constexpr int kStride = HEAD_DIM + kPad;     // elements per Q / K / V row in shared memory
  constexpr int kPStride = kKeys + kPad;       // elements per P row
  constexpr int kChunks = HEAD_DIM / 8;        // 16-byte chunks per row
  constexpr int kKTiles = kKeys / 8;           // 8-key column tiles of S
  constexpr int kDSplit = dsplit(HEAD_DIM);    // warps that share one 8-key tile
  constexpr int kSteps = HEAD_DIM / 16;        // mma k-steps over head_dim
  constexpr int kDTiles = HEAD_DIM / 8;        // 8-wide column tiles of O
  constexpr int kOTiles = (kDTiles + kWarps - 1) / kWarps;  // per warp
  constexpr int kCopies = (kKeys * kChunks + kNumThreads - 1) / kNumThreads;  // per thread, per tile
  constexpr int kKeysPerThread = kKeys / 8;    // softmax: 8 threads per row
  static_assert(kKTiles * kDSplit == kWarps && kSteps % kDSplit == 0, "warp split of S");
  static_assert(smem_bytes(HEAD_DIM, kStages) <= kMaxStaticSmem, "static shared memory");
  scale *= k_scale;  // q . (fp8 * k_scale) = k_scale * (q . fp8)

  __shared__ __align__(16) T q_s[kRows * kStride];
  __shared__ __align__(16) T k_s[kStages * kKeys * kStride];
  __shared__ __align__(16) T v_s[kStages * kKeys * kStride];
  __shared__ float s_s[kDSplit * kRows * kKeys];
  __shared__ __align__(16) T p_s[kRows * kPStride];
  __shared__ float corr_s[kRows];
  __shared__ float l_s[kRows];

  const int item = blockIdx.x;
  const int seq = work_seq[item];
  const int first_item = part_start[seq];
  const int num_parts = part_start[seq + 1] - first_item;
  const int part = item - first_item;
  const int group = num_heads / num_kv_heads;
  const int head_groups = (group + kRows - 1) / kRows;
  const int kv_head = blockIdx.y / head_groups;
  const int head0 = kv_head * group + (blockIdx.y % head_groups) * kRows;
  const int rows = min(kRows, kv_head * group + group - head0);  // real heads of the 16
  const int ctx = seq_lens[seq];
  const int lo = window > 0 ? max(0, ctx - window) : 0;  // the first key the query sees
  const int start = min(ctx, lo + part * chunk);
  const int end = part == num_parts - 1 ? ctx : min(ctx, start + chunk);
  const int num_tiles = (end - start + kKeys - 1) / kKeys;
  const int* table = block_tables + static_cast<long long>(seq) * bt_stride;

  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // fragment row group and lane in the group

  // Q rows of the group (zeros for the padding rows), committed with the first K/V tile.
  const T* q_seq = query + static_cast<long long>(seq) * q_stride;
  for (int idx = tid; idx < kRows * kChunks; idx += kNumThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < rows;
    cp_async_16_zfill(&q_s[r * kStride + c * 8],
                      ok ? q_seq + (head0 + r) * HEAD_DIM + c * 8 : q_seq, ok ? 16 : 0);
  }

  // Element offsets of this thread's K/V copies for one tile (-1: past the end, zero-filled).
  long long offs[kCopies];
  auto plan = [&](int tile) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = tid + i * kNumThreads;
      const int j = idx / kChunks, c = idx % kChunks;
      const int pos = start + tile * kKeys + j;
      offs[i] = -1;
      if (idx < kKeys * kChunks && tile < num_tiles && pos < end) {
        const long long phys = table[pos / BLOCK_SIZE];
        offs[i] = ((phys * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
      }
    }
  };
  auto issue = [&](int stage) {
    T* ks = k_s + stage * kKeys * kStride;
    T* vs = v_s + stage * kKeys * kStride;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = tid + i * kNumThreads;
      if (idx < kKeys * kChunks) {
        const int j = idx / kChunks, c = idx % kChunks;
        const bool ok = offs[i] >= 0;
        const long long off = ok ? offs[i] : 0;
        if constexpr (IsFp8<C>::value) {
          fp8x8_to_smem(&ks[j * kStride + c * 8], k_cache + off, ok);
          fp8x8_to_smem(&vs[j * kStride + c * 8], v_cache + off, ok);
        } else {
          cp_async_16_zfill(&ks[j * kStride + c * 8], k_cache + off, ok ? 16 : 0);
          cp_async_16_zfill(&vs[j * kStride + c * 8], v_cache + off, ok ? 16 : 0);
        }
      }
    }
  };

  // Prologue: tiles 0 .. kStages - 2 in flight (a group per stage, empty ones too, so that
  // the wait below always counts the same number of groups).
  plan(0);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < num_tiles) {
      issue(st);
      plan(st + 1);
    }
    cp_async_commit();
  }

  const int prow = tid / 8, pl = tid % 8;  // softmax: row and lane within the row's 8 threads
  float m_run = neg_inf(), l_run = 0.0f;
  const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;  // no division per score
  float o[kOTiles][4];
#pragma unroll
  for (int j = 0; j < kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<kStages - 2>();  // this thread's copies of `tile` (and Q) have landed
    __syncthreads();               // everyone's; and every warp is done with tile - 1
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      issue(next % kStages);  // into the stage tile - 1 used
      plan(next + 1);
    }
    cp_async_commit();
    const T* ks = k_s + (tile % kStages) * kKeys * kStride;
    const T* vs = v_s + (tile % kStages) * kKeys * kStride;
    const int tile_start = start + tile * kKeys;

    // 1. S = Q K^T for the warp's 8 keys (over its share of head_dim).
    {
      const int nt = warp % kKTiles, dpart = warp / kKTiles;
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = dpart * (kSteps / kDSplit); kk < (dpart + 1) * (kSteps / kDSplit); ++kk) {
        unsigned qa[4], kb[2];
        ldmatrix_x4(qa, &q_s[(lane % 16) * kStride + kk * 16 + (lane / 16) * 8]);
        ldmatrix_x2(kb, &ks[(nt * 8 + lane % 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8]);
        mma_m16n8k16<T>(s, qa, kb, s);
      }
      float* sp = s_s + dpart * kRows * kKeys;
      sp[g * kKeys + nt * 8 + 2 * t] = s[0];
      sp[g * kKeys + nt * 8 + 2 * t + 1] = s[1];
      sp[(g + 8) * kKeys + nt * 8 + 2 * t] = s[2];
      sp[(g + 8) * kKeys + nt * 8 + 2 * t + 1] = s[3];
    }
    __syncthreads();

    // 2. Online softmax over the tile, one row per 8 consecutive threads (one warp's lanes).
    {
      float sv[kKeysPerThread];
      float tmax = neg_inf();
#pragma unroll
      for (int i = 0; i < kKeysPerThread; ++i) {
        const int key = pl * kKeysPerThread + i;
        float x = 0.0f;
#pragma unroll
        for (int dp = 0; dp < kDSplit; ++dp) x += s_s[(dp * kRows + prow) * kKeys + key];
        x *= scale;
        if (soft_cap > 0.0f) x = soft_cap * tanhf(x * inv_cap);
        if (tile_start + key >= end) x = neg_inf();
        sv[i] = x;
        tmax = fmaxf(tmax, x);
      }
#pragma unroll
      for (int offset = 4; offset > 0; offset >>= 1)
        tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, offset));
      const float m_new = fmaxf(m_run, tmax);
      const float base = m_new == neg_inf() ? 0.0f : m_new;  // nothing seen yet
      const float corr = __expf(m_run - base);
      float psum = 0.0f;
#pragma unroll
      for (int i = 0; i < kKeysPerThread; i += 2) {
        const unsigned pp = pack2<T>(__expf(sv[i] - base), __expf(sv[i + 1] - base));
        const T* pe = reinterpret_cast<const T*>(&pp);
        // The sum takes P as rounded for the mma, so O / l weighs exactly what was summed.
        psum += to_float(pe[0]) + to_float(pe[1]);
        *reinterpret_cast<unsigned*>(&p_s[prow * kPStride + pl * kKeysPerThread + i]) = pp;
      }
#pragma unroll
      for (int offset = 4; offset > 0; offset >>= 1)
        psum += __shfl_xor_sync(kFullMask, psum, offset);
      l_run = l_run * corr + psum;
      m_run = m_new;
      if (pl == 0) corr_s[prow] = corr;
    }
    __syncthreads();

    // 3. O = corr * O + P V on the warp's column tiles.
    {
      const float c0 = corr_s[g], c1 = corr_s[g + 8];
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        o[j][0] *= c0;
        o[j][1] *= c0;
        o[j][2] *= c1;
        o[j][3] *= c1;
      }
#pragma unroll
      for (int kc = 0; kc < kKeys / 16; ++kc) {
        unsigned pa[4];
        ldmatrix_x4(pa, &p_s[(lane % 16) * kPStride + kc * 16 + (lane / 16) * 8]);
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
          const int dt = warp + j * kWarps;
          if (dt < kDTiles) {  // warp-uniform
            unsigned vb[2];
            ldmatrix_x2_trans(vb, &vs[(kc * 16 + lane % 16) * kStride + dt * 8]);
            mma_m16n8k16<T>(o[j], pa, vb, o[j]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing left in flight (an empty context issued Q only)

  const bool split = num_parts > 1;
  if (pl == 0) {
    l_s[prow] = l_run;
    if (split && prow < rows) {
      const long long ih = static_cast<long long>(item) * num_heads + head0 + prow;
      part_max[ih] = m_run;
      part_sum[ih] = l_run;
    }
  }
  __syncthreads();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    if (r >= rows) continue;
    const float l = l_s[r];
    const float inv = l > 0.0f ? v_scale / l : 0.0f;  // empty context: zeros
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
      const int dt = warp + j * kWarps;
      if (dt >= kDTiles) continue;
      const int col = dt * 8 + 2 * t;
      const float a = o[j][2 * half] * inv, b = o[j][2 * half + 1] * inv;
      if (split) {
        float* dst = part_out + (static_cast<long long>(item) * num_heads + head0 + r) * HEAD_DIM;
        dst[col] = a;
        dst[col + 1] = b;
      } else {
        T* dst = out + (static_cast<long long>(seq) * num_heads + head0 + r) * HEAD_DIM;
        dst[col] = from_float<T>(a);
        dst[col + 1] = from_float<T>(b);
      }
    }
  }
}

// Merges the partials of the split sequences: out = sum_p w_p o_p / sum_p w_p with
// w_p = sum_p * exp(max_p - max). Grid (num_heads, num_seqs); a sequence with one partition
// was written by the decode kernel and is skipped. Dynamic shared memory: one float per
// partition of the longest sequence.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128) paged_attention_decode_gqa_merge(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ part_start) {
  using namespace noria;
  using namespace noria::decode_gqa;
  extern __shared__ __align__(16) unsigned char merge_smem[];
  float* weight = reinterpret_cast<float*>(merge_smem);
  __shared__ float scratch[kWarps];

  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
  const int first = part_start[seq];
  const int parts = part_start[seq + 1] - first;
  if (parts <= 1) return;  // uniform for the CTA, before any barrier

  float mx = neg_inf();
  for (int p = threadIdx.x; p < parts; p += kNumThreads)
    mx = fmaxf(mx, part_max[static_cast<long long>(first + p) * num_heads + head]);
  mx = block_max<kWarps>(mx, scratch);

  float s = 0.0f;
  for (int p = threadIdx.x; p < parts; p += kNumThreads) {
    const long long ih = static_cast<long long>(first + p) * num_heads + head;
    const float w = part_sum[ih] * __expf(part_max[ih] - mx);
    weight[p] = w;
    s += w;
  }
  s = block_sum<kWarps>(s, scratch);  // its barriers also publish weight[]

  const long long sh = static_cast<long long>(seq) * num_heads + head;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) {
    float o = 0.0f;
    for (int p = 0; p < parts; ++p)
      o += weight[p] * part_out[(static_cast<long long>(first + p) * num_heads + head) * HEAD_DIM + d];
    out[sh * HEAD_DIM + d] = from_float<T>(s > 0.0f ? o / s : 0.0f);
  }
}
