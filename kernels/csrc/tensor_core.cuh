// Tensor-core and asynchronous-copy building blocks (sm_80 and later): mma.sync, ldmatrix,
// cp.async. On a GPU each function is one inline PTX instruction; under the CPU emulator
// (CUDAEMU) it is the emulator's warp-collective model of that instruction
// (kernels/emu/include/cudaemu/tensor_core.h), so kernels built on this header run in CI.
//
// Fragments follow the PTX ISA ("Matrix Fragments for mma.m16n8k16 / mma.m16n8k8"), with
// groupID = lane / 4, tig = lane % 4, and the lower 16 bits of a register holding the element
// with the lower index:
//   A (16 x 16, row-major): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
//                           a[3] = A[g+8][2t+8..]          (m16n8k8: a[0], a[1] only)
//   B (16 x 8, "col"):      b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]   (k8: b[0])
//   C, D (16 x 8, float):   c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// ldmatrix: lane 8j + r gives the 16-byte-aligned shared address of row r of matrix j; register
// j receives matrix j's row lane/4, columns 2t, 2t+1 (.trans: column lane/4, rows 2t, 2t+1).
// An x4 load of a row-major 16 x 16 tile (lanes 0-15 rows 0-15 at column 0, lanes 16-31 rows
// 0-15 at column 8) gives exactly an A fragment.
//
// Every lane of the warp must call an mma / ldmatrix at the same place (.sync.aligned).
// cp.async data may land at any moment until the issuing thread's cp_async_wait that covers its
// group; other threads need a __syncthreads after that wait.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifdef CUDAEMU
// The emulator checks that a warp's lanes meet at the same call site.
#define NORIA_TC_SITE , const char *tc_file = __builtin_FILE(), unsigned tc_line = __builtin_LINE()
#define NORIA_TC_FWD , tc_file, tc_line
#else
#define NORIA_TC_SITE
#define NORIA_TC_FWD
#endif

namespace noria {

#ifndef CUDAEMU
// The 32-bit shared-state-space address PTX's .shared operands take.
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// ---- mma.sync: D = A B + C, float accumulators ----

__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const unsigned a[4],
                                                  const unsigned b[2],
                                                  const float c[4] NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::mma(cudaemu::Op::MmaK16Bf16, d, a, b, c, tc_file, tc_line);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

__device__ __forceinline__ void mma_m16n8k16_f16(float d[4], const unsigned a[4],
                                                 const unsigned b[2],
                                                 const float c[4] NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::mma(cudaemu::Op::MmaK16F16, d, a, b, c, tc_file, tc_line);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

__device__ __forceinline__ void mma_m16n8k8_bf16(float d[4], const unsigned a[2],
                                                 const unsigned b[1],
                                                 const float c[4] NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::mma(cudaemu::Op::MmaK8Bf16, d, a, b, c, tc_file, tc_line);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%7, %8, %9, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

__device__ __forceinline__ void mma_m16n8k8_f16(float d[4], const unsigned a[2],
                                                const unsigned b[1],
                                                const float c[4] NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::mma(cudaemu::Op::MmaK8F16, d, a, b, c, tc_file, tc_line);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%7, %8, %9, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

// The element type picks the instruction: mma_m16n8k16<__nv_bfloat16>(d, a, b, c).
template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void k16(float d[4], const unsigned a[4], const unsigned b[2],
                                             const float c[4] NORIA_TC_SITE) {
    mma_m16n8k16_bf16(d, a, b, c NORIA_TC_FWD);
  }
};
template <>
struct Mma<__half> {
  __device__ __forceinline__ static void k16(float d[4], const unsigned a[4], const unsigned b[2],
                                             const float c[4] NORIA_TC_SITE) {
    mma_m16n8k16_f16(d, a, b, c NORIA_TC_FWD);
  }
};
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2],
                                             const float c[4] NORIA_TC_SITE) {
  Mma<T>::k16(d, a, b, c NORIA_TC_FWD);
}

// Two floats rounded to one register of 16-bit elements (lo in the lower half), e.g. the
// probabilities P of attention turned into an A fragment.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
  return static_cast<unsigned>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<unsigned>(__half_as_ushort(__float2half_rn(hi))) << 16);
}
// The same for a kernel templated on its element type.
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

// ---- ldmatrix: 8x8 b16 matrices from shared memory into fragments ----

__device__ __forceinline__ void ldmatrix_x1(unsigned r[1], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX1, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(smem_address(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX2, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX4, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x1_trans(unsigned r[1], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX1T, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(smem_address(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned r[2], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX2T, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* smem NORIA_TC_SITE) {
#ifdef CUDAEMU
  cudaemu::ldmatrix(cudaemu::Op::LdmX4T, r, smem, tc_file, tc_line);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
#endif
}

// ---- cp.async: global -> shared without registers ----
// The "memory" clobbers keep the compiler from moving shared-memory accesses across them.

// 16 bytes, cached in L2 only (.cg): streaming K/V tiles. Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#ifdef CUDAEMU
  cudaemu::cp_async(smem, gmem, 16, 16, true);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(smem)),
               "l"(gmem)
               : "memory");
#endif
}

// 16 bytes of which the first src_bytes (0..16) are read and the rest zero-filled: a tile
// row past the end of the data costs no branch and reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, int src_bytes) {
#ifdef CUDAEMU
  cudaemu::cp_async(smem, gmem, 16, static_cast<unsigned>(src_bytes), true);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
#endif
}

// 4, 8 or 16 bytes, cached in L1 too (.ca).
template <int Bytes>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
#ifdef CUDAEMU
  cudaemu::cp_async(smem, gmem, Bytes, Bytes, false);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "n"(Bytes)
               : "memory");
#endif
}

// Closes this thread's current group of copies (an empty group is fine).
__device__ __forceinline__ void cp_async_commit() {
#ifdef CUDAEMU
  cudaemu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group counts groups");
#ifdef CUDAEMU
  cudaemu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Commits the open group and waits for everything.
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef CUDAEMU
  cudaemu::cp_async_wait_all();
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace noria

#undef NORIA_TC_SITE
#undef NORIA_TC_FWD
