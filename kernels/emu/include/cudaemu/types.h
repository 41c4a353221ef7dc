// Built-in vector types (uint3, dim3, float4, uint4, ...) with CUDA's sizes and alignments.
#pragma once

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

#define CUDAEMU_VEC2(T, name, align) \
  struct __attribute__((aligned(align))) name { T x, y; }; \
  inline name make_##name(T x, T y) { return name{x, y}; }
#define CUDAEMU_VEC4(T, name, align) \
  struct __attribute__((aligned(align))) name { T x, y, z, w; }; \
  inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

CUDAEMU_VEC2(float, float2, 8)
CUDAEMU_VEC4(float, float4, 16)
CUDAEMU_VEC2(int, int2, 8)
CUDAEMU_VEC4(int, int4, 16)
CUDAEMU_VEC2(unsigned int, uint2, 8)
CUDAEMU_VEC4(unsigned int, uint4, 16)
CUDAEMU_VEC2(double, double2, 16)

#undef CUDAEMU_VEC2
#undef CUDAEMU_VEC4

inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

constexpr int warpSize = 32;
