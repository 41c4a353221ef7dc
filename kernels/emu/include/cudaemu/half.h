// __half and __nv_bfloat16 as 16-bit storage types. Conversions round to nearest even in
// software (bit-exact with numpy / torch); arithmetic goes through float.
#pragma once

#include <stdint.h>
#include <string.h>

namespace cudaemu {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16_rn(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN stays NaN (quiet)
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): adding 0.5 aligns the value's units of 2^-24 with
    // the float mantissa's last bit, and the FPU's own round-to-nearest-even does the rest.
    const float shifted = f32_from_bits(a) + 0.5f;
    return sign | static_cast<uint16_t>(f32_bits(shifted) - f32_bits(0.5f));
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t r = a + 0xc8000fffu + odd;  // 0xc8000000 rebias (-112 << 23), 0xfff + odd rounds
  return sign | static_cast<uint16_t>(r >> 13);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return f32_from_bits(f32_bits(v) | sign);
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_bf16_rn(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t odd = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + odd) >> 16);
}

inline float bf16_to_f32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

}  // namespace cudaemu

struct __half {
  unsigned short __x;
  __half() = default;
  __half(float f) : __x(cudaemu::f32_to_f16_rn(f)) {}
  __half(double f) : __x(cudaemu::f32_to_f16_rn(static_cast<float>(f))) {}
  __half(int i) : __x(cudaemu::f32_to_f16_rn(static_cast<float>(i))) {}
  operator float() const { return cudaemu::f16_to_f32(__x); }
};

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(cudaemu::f32_to_bf16_rn(f)) {}
  __nv_bfloat16(double f) : __x(cudaemu::f32_to_bf16_rn(static_cast<float>(f))) {}
  __nv_bfloat16(int i) : __x(cudaemu::f32_to_bf16_rn(static_cast<float>(i))) {}
  operator float() const { return cudaemu::bf16_to_f32(__x); }
};

typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

inline float __half2float(__half h) { return cudaemu::f16_to_f32(h.__x); }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.__x = u;
  return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __float2half_rn(float f) { return __ushort_as_half(cudaemu::f32_to_f16_rn(f)); }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __hadd(__half a, __half b) { return __float2half_rn(float(a) + float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half_rn(float(a) * float(b)); }

inline float __bfloat162float(__nv_bfloat16 b) { return cudaemu::bf16_to_f32(b.__x); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  __nv_bfloat16 b;
  b.__x = u;
  return b;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __ushort_as_bfloat16(cudaemu::f32_to_bf16_rn(f));
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
