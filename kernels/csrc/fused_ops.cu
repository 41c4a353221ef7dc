// Fused elementwise steps of a decoder layer, so that a layer costs one launch per step
// instead of a chain of torch operators: the residual add with RMSNorm, rotary embedding of
// q and k read in place from the fused QKV projection together with the KV-cache write, and
// SiLU-and-mul. Each rounds where the torch operators it replaces round (the residual sum, the
// normalized row, the SiLU output are stored in T before the next product), so in float32 the
// result differs from torch only in the order of the sum of squares.

#include "common.cuh"
#include "fp8.cuh"

namespace noria {

// kVec consecutive elements moved with one load or store (kVec * sizeof(T) bytes, aligned).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

template <typename T, int kVec>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kVec>& x) {
  *reinterpret_cast<Pack<T, kVec>*>(p) = x;
}

// x rounded to T and widened back: where a torch operator in T would have stored it.
template <typename T>
__device__ __forceinline__ float rounded(float x) {
  return to_float(from_float<T>(x));
}

// Sum over a block of whole warps (blockDim.x a multiple of 32, at most 1024 threads).
__device__ __forceinline__ float block_sum_any(float v, float* scratch) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < num_warps; ++w) r += scratch[w];
  return r;
}

}  // namespace noria

using namespace noria;

// out = rmsnorm(x + residual) * weight, residual <- x + residual (in place); without a
// residual (has_residual 0: the first layer; residual is then not touched) out =
// rmsnorm(x) * weight. One CTA per row; kVec
// elements per access where the hidden size, the strides and the pointers allow it.
// x, residual, out: rows of `hidden` elements at their own row strides; weight: [hidden].
template <typename T, int kVec>
__global__ void __launch_bounds__(1024) fused_add_rms_norm(
    const T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
    T* __restrict__ out, int hidden, int has_residual, long long x_stride,
    long long residual_stride, long long out_stride, float eps) {
  __shared__ float scratch[kWarpSize];
  const long long row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* rr = has_residual ? residual + row * residual_stride : nullptr;
  const int num_vecs = hidden / kVec;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Pack<T, kVec> a = load_pack<T, kVec>(xr + i * kVec);
    if (rr != nullptr) {
      const Pack<T, kVec> b = load_pack<T, kVec>(rr + i * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
      store_pack<T, kVec>(rr + i * kVec, a);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = to_float(a.v[j]);
      sum_sq += f * f;
    }
  }
  const float inv_rms = rsqrtf(block_sum_any(sum_sq, scratch) / hidden + eps);
  // Each thread reads back only the elements it summed (and stored) itself: no barrier.
  const T* src = rr != nullptr ? rr : xr;
  T* o = out + row * out_stride;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const Pack<T, kVec> a = load_pack<T, kVec>(src + i * kVec);
    const Pack<T, kVec> w = load_pack<T, kVec>(weight + i * kVec);
    Pack<T, kVec> r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float normed = rounded<T>(to_float(a.v[j]) * inv_rms);
      r.v[j] = from_float<T>(to_float(w.v[j]) * normed);
    }
    store_pack<T, kVec>(o + i * kVec, r);
  }
}

// Neox-style rotary embedding (rotate halves) of the q and k heads of a fused QKV row, in
// place, and the KV-cache write of the rotated k and of v (reshape_and_cache's contract: a
// negative slot is not stored). One CTA per token.
// qkv: token t's row at qkv + t * qkv_stride: num_heads q heads, num_kv_heads k heads,
// num_kv_heads v heads, head_dim elements each. cos / sin: token t's rot_half values at
// t * cs_stride. The first 2 * rot_half dims of a head rotate (rot_half < head_dim / 2:
// partial rotary, Phi-3); the dims after them pass through, and k's are cached as they are.
// k/v_cache: [num_blocks, block_size, num_kv_heads, head_dim] of C: T, or noria::fp8_e4m3
// (stored as fp8(k / k_scale), fp8(v / v_scale); other caches ignore the scales).
template <typename T, typename SlotT, typename C = T>
__global__ void __launch_bounds__(256) rotary_qkv_cache(
    T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
    C* __restrict__ k_cache, C* __restrict__ v_cache, const SlotT* __restrict__ slot_mapping,
    long long qkv_stride, long long cs_stride, int num_heads, int num_kv_heads, int head_dim,
    int rot_half, float k_scale, float v_scale) {
  const long long token = blockIdx.x;
  T* row = qkv + token * qkv_stride;
  const T* c = cos + token * cs_stride;
  const T* s = sin + token * cs_stride;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  const int half = rot_half;
  const int kv_elems = num_kv_heads * head_dim;
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half, i = p - head * half;  // k heads follow the q heads in the row
    T* h = row + head * head_dim;
    const float x1 = to_float(h[i]), x2 = to_float(h[i + half]);
    const float cf = to_float(c[i]), sf = to_float(s[i]);
    // As torch's x1 * cos - x2 * sin in T: each product rounded to T (and never fused into
    // an fma), then the sum.
    const T y1 = from_float<T>(rounded<T>(__fmul_rn(x1, cf)) - rounded<T>(__fmul_rn(x2, sf)));
    const T y2 = from_float<T>(rounded<T>(__fmul_rn(x2, cf)) + rounded<T>(__fmul_rn(x1, sf)));
    h[i] = y1;
    h[i + half] = y2;
    if (head >= num_heads && slot >= 0) {
      C* dst = k_cache + slot * kv_elems + (head - num_heads) * head_dim;
      cache_store(dst + i, y1, k_scale);
      cache_store(dst + i + half, y2, k_scale);
    }
  }
  if (slot < 0) return;  // after the rotation: q and k are rotated for every token
  const int rot = 2 * half, pass = head_dim - rot;
  const T* k = row + num_heads * head_dim;
  for (int e = threadIdx.x; e < num_kv_heads * pass; e += blockDim.x) {
    const int off = (e / pass) * head_dim + rot + e % pass;  // k's dims past the rotary ones
    cache_store(k_cache + slot * kv_elems + off, k[off], k_scale);
  }
  const T* v = row + (num_heads + num_kv_heads) * head_dim;
  C* dst = v_cache + slot * kv_elems;
  for (int e = threadIdx.x; e < kv_elems; e += blockDim.x) cache_store(dst + e, v[e], v_scale);
}

// out = silu(gate) * up for gate_up rows [gate (inter) | up (inter)]. Grid (rows, column
// chunks of blockDim.x * kVec elements).
template <typename T, int kVec>
__global__ void __launch_bounds__(256) silu_and_mul(
    const T* __restrict__ gate_up, T* __restrict__ out, int inter, long long in_stride,
    long long out_stride) {
  const long long row = blockIdx.x;
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter / kVec) return;
  const T* g = gate_up + row * in_stride + i * kVec;
  const Pack<T, kVec> gv = load_pack<T, kVec>(g);
  const Pack<T, kVec> uv = load_pack<T, kVec>(g + inter);
  Pack<T, kVec> r;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float x = to_float(gv.v[j]);
    const float silu = rounded<T>(x / (1.f + expf(-x)));
    r.v[j] = from_float<T>(silu * to_float(uv.v[j]));
  }
  store_pack<T, kVec>(out + row * out_stride + i * kVec, r);
}
