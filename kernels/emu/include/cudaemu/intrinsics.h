// Device intrinsics: barriers, warp shuffles and votes, atomics, math and bit helpers.
#pragma once

#include <math.h>
#include <string.h>

#include <type_traits>

#include "collectives.h"

CUDAEMU_RUNTIME inline void __syncthreads() { cudaemu::block_barrier(cudaemu::BarrierKind::Plain, 0); }
CUDAEMU_RUNTIME inline int __syncthreads_count(int pred) {
  return cudaemu::block_barrier(cudaemu::BarrierKind::Count, pred);
}
CUDAEMU_RUNTIME inline int __syncthreads_and(int pred) {
  return cudaemu::block_barrier(cudaemu::BarrierKind::And, pred);
}
CUDAEMU_RUNTIME inline int __syncthreads_or(int pred) {
  return cudaemu::block_barrier(cudaemu::BarrierKind::Or, pred);
}

CUDAEMU_RUNTIME inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cudaemu::collective(cudaemu::Op::SyncWarp, mask, 0, 0, 0, 32);
}

namespace cudaemu {
template <typename T>
CUDAEMU_RUNTIME inline T shuffle(Op op, unsigned mask, T var, int param, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "shuffles move at most 8 bytes of trivially copyable data");
  uint64_t bits = 0;
  memcpy(&bits, &var, sizeof(T));
  const uint64_t r = collective(op, mask, bits, param, 0, width);
  T out;
  memcpy(&out, &r, sizeof(T));
  return out;
}
}  // namespace cudaemu

template <typename T>
CUDAEMU_RUNTIME inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return cudaemu::shuffle(cudaemu::Op::ShflIdx, mask, var, src_lane, width);
}
template <typename T>
CUDAEMU_RUNTIME inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return cudaemu::shuffle(cudaemu::Op::ShflUp, mask, var, static_cast<int>(delta), width);
}
template <typename T>
CUDAEMU_RUNTIME inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return cudaemu::shuffle(cudaemu::Op::ShflDown, mask, var, static_cast<int>(delta), width);
}
template <typename T>
CUDAEMU_RUNTIME inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return cudaemu::shuffle(cudaemu::Op::ShflXor, mask, var, lane_mask, width);
}

CUDAEMU_RUNTIME inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(cudaemu::collective(cudaemu::Op::Ballot, mask, 0, 0, pred, 32));
}
CUDAEMU_RUNTIME inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(cudaemu::collective(cudaemu::Op::Any, mask, 0, 0, pred, 32));
}
CUDAEMU_RUNTIME inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(cudaemu::collective(cudaemu::Op::All, mask, 0, 0, pred, 32));
}
// Without a model of divergence this is the set of lanes that have not exited.
CUDAEMU_RUNTIME inline unsigned __activemask() {
  const cudaemu::Worker* w = cudaemu::cur_worker();
  const cudaemu::WarpState& ws = w->warps[w->cur->warp];
  return ws.exists & ~ws.exited;
}

#define CUDAEMU_REDUCE(name, T, OPU)                                                        \
  CUDAEMU_RUNTIME inline T name(unsigned mask, T value) {                                  \
    return static_cast<T>(cudaemu::collective(cudaemu::Op::OPU, mask,                      \
                                              static_cast<uint32_t>(value), 0, 0, 32));    \
  }
CUDAEMU_REDUCE(__reduce_add_sync, unsigned, ReduceAddU)
CUDAEMU_REDUCE(__reduce_add_sync, int, ReduceAddI)
CUDAEMU_REDUCE(__reduce_min_sync, unsigned, ReduceMinU)
CUDAEMU_REDUCE(__reduce_min_sync, int, ReduceMinI)
CUDAEMU_REDUCE(__reduce_max_sync, unsigned, ReduceMaxU)
CUDAEMU_REDUCE(__reduce_max_sync, int, ReduceMaxI)
#undef CUDAEMU_REDUCE

// Blocks run concurrently on several OS threads, so global atomics must be real ones.
template <typename T>
CUDAEMU_RUNTIME inline T cudaemu_atomic_rmw_cas(T* addr, T (*f)(T, T), T v) {
  T old = __atomic_load_n(addr, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(addr, &old, f(old, v), false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}

#define CUDAEMU_ATOMIC_INT(T)                                                                   \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }         \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }         \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }       \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }         \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }           \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }         \
  inline T atomicMax(T* a, T v) {                                                              \
    return cudaemu_atomic_rmw_cas<T>(a, [](T x, T y) { return x > y ? x : y; }, v);            \
  }                                                                                            \
  inline T atomicMin(T* a, T v) {                                                              \
    return cudaemu_atomic_rmw_cas<T>(a, [](T x, T y) { return x < y ? x : y; }, v);            \
  }                                                                                            \
  inline T atomicCAS(T* a, T compare, T v) {                                                   \
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);    \
    return compare;                                                                            \
  }
CUDAEMU_ATOMIC_INT(int)
CUDAEMU_ATOMIC_INT(unsigned int)
CUDAEMU_ATOMIC_INT(long long)
CUDAEMU_ATOMIC_INT(unsigned long long)
#undef CUDAEMU_ATOMIC_INT

#define CUDAEMU_ATOMIC_FLOAT(T, U)                                                      \
  inline T atomicAdd(T* a, T v) {                                                      \
    U* ua = reinterpret_cast<U*>(a);                                                   \
    U old = __atomic_load_n(ua, __ATOMIC_RELAXED);                                     \
    for (;;) {                                                                         \
      T f;                                                                             \
      memcpy(&f, &old, sizeof(T));                                                     \
      f += v;                                                                          \
      U desired;                                                                       \
      memcpy(&desired, &f, sizeof(T));                                                 \
      if (__atomic_compare_exchange_n(ua, &old, desired, false, __ATOMIC_SEQ_CST,      \
                                      __ATOMIC_RELAXED)) {                             \
        memcpy(&f, &old, sizeof(T));                                                   \
        return f;                                                                      \
      }                                                                                \
    }                                                                                  \
  }                                                                                    \
  inline T atomicExch(T* a, T v) {                                                     \
    U uv;                                                                              \
    memcpy(&uv, &v, sizeof(T));                                                        \
    U old = __atomic_exchange_n(reinterpret_cast<U*>(a), uv, __ATOMIC_SEQ_CST);        \
    T f;                                                                               \
    memcpy(&f, &old, sizeof(T));                                                       \
    return f;                                                                          \
  }
CUDAEMU_ATOMIC_FLOAT(float, uint32_t)
CUDAEMU_ATOMIC_FLOAT(double, uint64_t)
#undef CUDAEMU_ATOMIC_FLOAT

CUDAEMU_RUNTIME inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
CUDAEMU_RUNTIME inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
CUDAEMU_RUNTIME inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

[[noreturn]] CUDAEMU_RUNTIME inline void __trap() { cudaemu::fail("__trap() called"); }
CUDAEMU_RUNTIME inline void __nanosleep(unsigned) {}

// Math: the fast intrinsics are computed with libm, so results differ from a GPU in the
// last bits; tests compare with tolerances.
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  memcpy(&i, &f, 4);
  return i;
}
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
inline double __longlong_as_double(long long i) {
  double d;
  memcpy(&d, &i, 8);
  return d;
}
inline long long __double_as_longlong(double d) {
  long long i;
  memcpy(&i, &d, 8);
  return i;
}

#define CUDAEMU_MINMAX(T)                              \
  inline T min(T a, T b) { return a < b ? a : b; }     \
  inline T max(T a, T b) { return a > b ? a : b; }
CUDAEMU_MINMAX(int)
CUDAEMU_MINMAX(unsigned int)
CUDAEMU_MINMAX(long long)
CUDAEMU_MINMAX(unsigned long long)
#undef CUDAEMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
