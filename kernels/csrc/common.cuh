// Shared helpers for noria's kernels: element conversions, 16-byte vector loads and warp /
// block reductions. Device-only code, no host code and no std headers, so that the same
// text compiles under NVRTC (CuPy) and under the CPU emulator (g++).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace noria {

constexpr int kWarpSize = 32;  // warpSize is not a constant expression in CUDA
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Elements of T in one 16-byte load.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

// Loads 16 bytes (the address must be 16-byte aligned) and widens them to float.
template <typename T>
__device__ __forceinline__ void load16_as_float(const T* p, float (&out)[Vec16<T>::kElems]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::kElems; ++i) out[i] = to_float(e[i]);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Block-wide max / sum for kNumWarps full warps. `scratch` holds kNumWarps floats; the
// trailing barrier lets the caller reuse it for the next reduction right away.
template <int kNumWarps>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();
  return r;
}

template <int kNumWarps>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kNumWarps; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

}  // namespace noria
