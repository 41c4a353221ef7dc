// The fp8 (e4m3, "float8_e4m3fn") KV cache's element conversions, written out instead of
// taken from CUDA's fp8 header so that NVRTC and the CPU emulator compile the same text (the
// emulator has no CUDA's fp8 header). A cache byte is stored as fp8(x / scale) and read as
// fp8 * scale, one scale per layer for K and one for V (worker/kv_fp8.py's contract; the
// kernels fold the K scale into the softmax scale and the V scale into the output).
#pragma once

#include "common.cuh"

namespace noria {

// A cache element type of `unsigned char` means e4m3 bytes.
using fp8_e4m3 = unsigned char;

template <typename C>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<fp8_e4m3> {
  static constexpr bool value = true;
};

constexpr float kFp8Max = 448.0f;  // the largest finite e4m3 value
// e4m3's exponent bias is 7, fp16's 15: a byte's bits shifted into an fp16 read as the e4m3
// value times 2^-8, subnormals included (both formats' subnormals then line up).
constexpr float kFp8Rebias = 256.0f;

// The exact value of an e4m3 byte. Through fp16, not float32: an e4m3 subnormal would be a
// float32 subnormal that -ftz flushes, while fp16 subnormals survive the conversion. e4m3's
// NaN (S.1111.111) would read as 480 that way, so it is mapped to NaN, as torch reads it.
__device__ __forceinline__ float fp8_to_float(fp8_e4m3 b) {
  const unsigned short h = static_cast<unsigned short>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
  const float x = __half2float(__ushort_as_half(h)) * kFp8Rebias;
  return (b & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : x;
}

// x as e4m3, rounded to nearest even and saturated to +-448 (CUDA's fp8 header's __NV_SATFINITE:
// infinities become +-448 too, NaN stays NaN).
__device__ __forceinline__ fp8_e4m3 fp8_from_float(float x) {
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (!(a == a)) return static_cast<fp8_e4m3>(sign | 0x7fu);
  if (a >= kFp8Max) return static_cast<fp8_e4m3>(sign | 0x7eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9; 8 steps is the smallest normal
    return static_cast<fp8_e4m3>(sign | static_cast<unsigned>(rintf(a * 512.0f)));
  }
  // Keep 3 of float32's 23 mantissa bits, ties to even; a carry moves into the exponent.
  unsigned u = __float_as_uint(a);
  u += 0x7ffffu + ((u >> 20) & 1u);
  const unsigned exp = (u >> 23) - (127 - 7);
  return static_cast<fp8_e4m3>(sign | (exp << 3) | ((u >> 20) & 7u));
}

// A cache store: the element as it is for a 16-bit / float cache, quantized with the layer's
// scale (a true division, as the torch path's x / scale) for an e4m3 one.
template <typename T>
__device__ __forceinline__ void cache_store(T* dst, T x, float) {
  *dst = x;
}
template <typename T>
__device__ __forceinline__ void cache_store(fp8_e4m3* dst, T x, float scale) {
  *dst = fp8_from_float(to_float(x) / scale);
}

// 8 cache elements widened to T and stored as 16 bytes (dst 16-byte aligned); zeros where
// `ok` is false, without reading src. For the tensor-core kernels' K/V tiles.
template <typename T>
__device__ __forceinline__ void fp8x8_to_smem(T* dst, const fp8_e4m3* src, bool ok) {
  uint2 raw = make_uint2(0u, 0u);
  if (ok) raw = *reinterpret_cast<const uint2*>(src);
  const fp8_e4m3* b = reinterpret_cast<const fp8_e4m3*>(&raw);
  uint4 packed;
  T* e = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(fp8_to_float(b[i]));
  *reinterpret_cast<uint4*>(dst) = packed;
}

}  // namespace noria
