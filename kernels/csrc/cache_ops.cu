// KV cache writes and block copies.

#include "common.cuh"
#include "fp8.cuh"

// Writes the step's new K and V into their cache slots. One CTA per token; a negative slot
// (padding, or a token whose KV is not kept) is skipped.
// key/value: token t, element i (over num_kv_heads * head_dim) at key + t * key_stride + i
// k/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset
// C:         the cache's element type: T, or noria::fp8_e4m3 (stored as fp8(k / k_scale),
//            fp8(v / v_scale)); other caches ignore the scales
template <typename T, typename SlotT, typename C = T>
__global__ void __launch_bounds__(256) reshape_and_cache(
    const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ k_cache,
    C* __restrict__ v_cache, const SlotT* __restrict__ slot_mapping, int key_stride,
    int value_stride, int row_elems, float k_scale, float v_scale) {
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0) return;
  // A slot is a row of row_elems elements, so its offset does not depend on the block size.
  const long long dst = slot * row_elems;
  const T* k = key + token * key_stride;
  const T* v = value + token * value_stride;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    noria::cache_store(k_cache + dst + i, k[i], k_scale);
    noria::cache_store(v_cache + dst + i, v[i], v_scale);
  }
}

// Copies whole blocks between caches: for each pair p and each cache c,
// dst[c] block mapping[p].y <- src[c] block mapping[p].x. One launch covers every layer's K
// and V cache of one step (swap-out, swap-in, or device to device). Pointers may be device or
// pinned host memory (UVA). Grid (num_pairs, num_caches); Unit is the copy granularity
// (uint4 when every base and the block size are 16-byte aligned).
template <typename Unit>
__global__ void __launch_bounds__(256) copy_blocks(
    const unsigned long long* __restrict__ src_bases,
    const unsigned long long* __restrict__ dst_bases, const long long* __restrict__ mapping,
    long long units_per_block) {
  const long long pair = blockIdx.x;
  const int cache = blockIdx.y;
  const long long src_block = mapping[2 * pair];
  const long long dst_block = mapping[2 * pair + 1];
  const Unit* src = reinterpret_cast<const Unit*>(src_bases[cache]) + src_block * units_per_block;
  Unit* dst = reinterpret_cast<Unit*>(dst_bases[cache]) + dst_block * units_per_block;
  for (long long i = threadIdx.x; i < units_per_block; i += blockDim.x) dst[i] = src[i];
}
