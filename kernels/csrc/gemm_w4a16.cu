// W4A16: y[M, N] = x[M, K] @ dequant(W).T (+ bias), 4-bit weights with a float32 scale (and an
// int8 zero point) per output column and group of input features: W[n][k] = (q - z) * s with
// q in [-8, 7]. 16-bit activations run on tensor cores (mma.sync m16n8k16), float32 ones on
// CUDA cores; both accumulate in float32.
//
// Packed weight layout (kernels/gemm_w4a16.py, pack_w4a16), after Marlin: the weight is cut
// into tiles of 16 columns x 16 input features, one 32-bit word per lane of a warp, and a
// tile's word for lane (g = lane / 4, t = lane % 4) holds exactly the eight values that lane
// needs as the B operand of two m16n8k16 mma's (columns n0 + g and n0 + 8 + g):
//   pair p (0..3) = (W[n0 + 8 (p / 2) + g][k0 + 2t + 8 (p % 2)], the same at k + 1),
//   the first value of pair p in bits 4p..4p+3, the second in bits 4p+16..4p+19,
//   each stored as q + 8 (0..15).
// So a pair is (word >> 4p) & 0x000f000f: the two halves of one mma B register, ready for the
// 0x6400 / 0x4300 exponent trick (not used yet: the values go through float, see w4_pair).
// Words are ordered [N / 16 tiles][K / 64 blocks][32 lanes][4 k16 steps]: a warp reads its
// next 64 input features of 16 columns as one 16-byte load per lane, 512 contiguous bytes.
// K is padded to 64 and N to 16 with zero nibbles; activations past K are read as zero, so
// the padding adds nothing. Scales: float32 [G][N16], zero points int8 [G][N16] (columns
// contiguous, so a warp's scales for one group are adjacent).
//
// Each group's products x * (q - z) are summed exactly as integers times activations (the
// mma's float32 accumulators), then scaled once per group: closer to the float64 reference
// than dequantizing W to 16 bits, and one multiply per group instead of one per weight.

#include "common.cuh"
#include "tensor_core.cuh"

namespace noria {

constexpr int kW4TileN = 16;  // columns per warp: one packed tile
constexpr int kW4Warps = 4;
constexpr int kW4Steps = 4;  // k16 steps per 16-byte word load (64 input features)
constexpr int kW4SimtRows = 8;  // rows per CTA of the float32 kernel

// Pair p of a packed word as two floats (q - z): the lane's B values at k and k + 1.
__device__ __forceinline__ float w4_value(unsigned word, int shift, int zero) {
  return static_cast<float>(static_cast<int>((word >> shift) & 0xfu) - 8 - zero);
}

__device__ __forceinline__ void w4_pair(unsigned word, int p, int zero, float& lo, float& hi) {
  const int lo_shift = 4 * p, hi_shift = 4 * p + 16;
  lo = w4_value(word, lo_shift, zero);
  hi = w4_value(word, hi_shift, zero);
}

// The running sum plus one group's sum times its scale, kept in float32.
template <typename T>
__device__ __forceinline__ float w4_accumulate(float acc, float part, float scale) {
  return acc + part * scale;
}

// Whether a warp's 16-column tile starting at n0 has any column to compute.
__device__ __forceinline__ bool w4_tile_live(int n0, int n) { return n0 < n; }

// The group of the k16 step that starts at input feature k0 (per-channel: group == K).
__device__ __forceinline__ int w4_group(int k0, int group) { return k0 / group; }

// Two activations x[row][col], x[row][col + 1] as the bits of one mma A register; zero past
// the rows and the input features.
template <typename T>
__device__ __forceinline__ unsigned w4_x_pair(const T* x, long long x_stride, int row, int col,
                                              int m, int k) {
  if (row >= m) return 0u;
  const unsigned short* p = reinterpret_cast<const unsigned short*>(x + row * x_stride);
  const unsigned lo = col < k ? p[col] : 0u;
  const unsigned hi = col + 1 < k ? p[col + 1] : 0u;
  return lo | (hi << 16);
}

__device__ __forceinline__ float w4_x(const float* x, long long x_stride, int row, int col, int k) {
  return col < k ? x[row * x_stride + col] : 0.f;
}

// One output: the final value in T (+ bias) with one split, else this split's float32 partial
// sum ([splits][m][n], added up by gemm_w4a16_reduce).
template <typename T>
__device__ __forceinline__ void w4_store(T* out, float* partial, const T* bias, int row, int col,
                                         int m, int n, int has_bias, float v) {
  if (row >= m || col >= n) return;
  const long long i = static_cast<long long>(row) * n + col;
  if (gridDim.z > 1) {
    partial[static_cast<long long>(blockIdx.z) * m * n + i] = v;
  } else {
    out[i] = from_float<T>(has_bias ? v + to_float(bias[col]) : v);
  }
}

}  // namespace noria

using namespace noria;

// Tensor cores. Grid (ceil(N / 64), ceil(M / (16 kMTiles)), splits); 4 warps, each owning one
// 16-column tile for 16 kMTiles rows: every weight word loaded feeds kMTiles x 2 mma's.
// blockIdx.z covers blocks_per_split of the K / 64 word blocks. A fragments come straight
// from global memory (L1 serves the warps of a CTA), so there is no shared memory and no
// barrier, and a warp past the last column may leave at once.
template <typename T, int kMTiles>
__global__ void __launch_bounds__(128) gemm_w4a16_tc(
    const T* __restrict__ x, const uint4* __restrict__ packed, const float* __restrict__ scales,
    const signed char* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, long long x_stride, int m, int n, int k, int n16, int group,
    int k_blocks, int blocks_per_split, int has_zero, int has_bias) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int tile = blockIdx.x * kW4Warps + warp;
  const int n0 = tile * kW4TileN;
  if (!w4_tile_live(n0, n)) return;
  const int row0 = blockIdx.y * 16 * kMTiles;
  const int kb_begin = blockIdx.z * blocks_per_split;
  const int kb_end = min(kb_begin + blocks_per_split, k_blocks);
  const int k_end = min(kb_end * kW4Steps * 16, k);
  float acc[kMTiles][2][4], part[kMTiles][2][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = part[i][j][e] = 0.f;
  const uint4* src = packed + static_cast<long long>(tile) * k_blocks * kWarpSize + lane;
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const uint4 words = src[static_cast<long long>(kb) * kWarpSize];
    const unsigned w[kW4Steps] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int s = 0; s < kW4Steps; ++s) {
      const int k0 = (kb * kW4Steps + s) * 16;
      if (k0 >= k_end) break;  // warp-uniform
      const int grp = w4_group(k0, group);
      const long long grow = static_cast<long long>(grp) * n16;
      const int z0 = has_zero ? zeros[grow + n0 + g] : 0;
      const int z1 = has_zero ? zeros[grow + n0 + 8 + g] : 0;
      unsigned b[2][2];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        float lo, hi;
        w4_pair(w[s], p, p < 2 ? z0 : z1, lo, hi);
        b[p / 2][p % 2] = pack2<T>(lo, hi);  // exact: small integers
      }
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        const int r = row0 + 16 * i + g;
        const unsigned a[4] = {w4_x_pair(x, x_stride, r, k0 + 2 * t, m, k),
                               w4_x_pair(x, x_stride, r + 8, k0 + 2 * t, m, k),
                               w4_x_pair(x, x_stride, r, k0 + 2 * t + 8, m, k),
                               w4_x_pair(x, x_stride, r + 8, k0 + 2 * t + 8, m, k)};
#pragma unroll
        for (int j = 0; j < 2; ++j) mma_m16n8k16<T>(part[i][j], a, b[j], part[i][j]);
      }
      if ((k0 + 16) % group == 0 || k0 + 16 >= k_end) {  // the group (or this split) ends
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // C columns are 2t, 2t + 1 of each 8-column half.
          const float s0 = scales[grow + n0 + 8 * j + 2 * t];
          const float s1 = scales[grow + n0 + 8 * j + 2 * t + 1];
#pragma unroll
          for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[i][j][e] = w4_accumulate<T>(acc[i][j][e], part[i][j][e], e % 2 ? s1 : s0);
              part[i][j][e] = 0.f;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        w4_store<T>(out, partial, bias, row0 + 16 * i + g + 8 * (e / 2), n0 + 8 * j + 2 * t + e % 2,
                    m, n, has_bias, acc[i][j][e]);
}

// CUDA cores (float32 activations). Grid (ceil(N / 64), ceil(M / 8), splits); 4 warps, one
// 16-column tile each, 8 rows per CTA. A lane multiplies its eight packed values by the
// matching activations of each row; the four lanes sharing a column (t = 0..3) add up at the
// end.
template <typename T>
__global__ void __launch_bounds__(128) gemm_w4a16_simt(
    const T* __restrict__ x, const uint4* __restrict__ packed, const float* __restrict__ scales,
    const signed char* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, long long x_stride, int m, int n, int k, int n16, int group,
    int k_blocks, int blocks_per_split, int has_zero, int has_bias) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int tile = blockIdx.x * kW4Warps + warp;
  const int n0 = tile * kW4TileN;
  if (!w4_tile_live(n0, n)) return;
  const int row0 = blockIdx.y * kW4SimtRows;
  const int kb_begin = blockIdx.z * blocks_per_split;
  const int kb_end = min(kb_begin + blocks_per_split, k_blocks);
  const int k_end = min(kb_end * kW4Steps * 16, k);
  float acc[kW4SimtRows][2], part[kW4SimtRows][2];
#pragma unroll
  for (int r = 0; r < kW4SimtRows; ++r) acc[r][0] = acc[r][1] = part[r][0] = part[r][1] = 0.f;
  const uint4* src = packed + static_cast<long long>(tile) * k_blocks * kWarpSize + lane;
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const uint4 words = src[static_cast<long long>(kb) * kWarpSize];
    const unsigned w[kW4Steps] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int s = 0; s < kW4Steps; ++s) {
      const int k0 = (kb * kW4Steps + s) * 16;
      if (k0 >= k_end) break;
      const int grp = w4_group(k0, group);
      const long long grow = static_cast<long long>(grp) * n16;
      const int z0 = has_zero ? zeros[grow + n0 + g] : 0;
      const int z1 = has_zero ? zeros[grow + n0 + 8 + g] : 0;
      float v[2][4];  // [column half][k + 2t, +1, +8, +9]
#pragma unroll
      for (int p = 0; p < 4; ++p) w4_pair(w[s], p, p < 2 ? z0 : z1, v[p / 2][2 * (p % 2)], v[p / 2][2 * (p % 2) + 1]);
      const int kc = k0 + 2 * t;
#pragma unroll
      for (int r = 0; r < kW4SimtRows; ++r) {
        const int row = row0 + r;
        if (row >= m) break;
        const float xa = w4_x(x, x_stride, row, kc, k), xb = w4_x(x, x_stride, row, kc + 1, k);
        const float xc = w4_x(x, x_stride, row, kc + 8, k), xd = w4_x(x, x_stride, row, kc + 9, k);
#pragma unroll
        for (int j = 0; j < 2; ++j)
          part[r][j] += xa * v[j][0] + xb * v[j][1] + xc * v[j][2] + xd * v[j][3];
      }
      if ((k0 + 16) % group == 0 || k0 + 16 >= k_end) {
        const float s0 = scales[grow + n0 + g], s1 = scales[grow + n0 + 8 + g];
#pragma unroll
        for (int r = 0; r < kW4SimtRows; ++r) {
          acc[r][0] = w4_accumulate<T>(acc[r][0], part[r][0], s0);
          acc[r][1] = w4_accumulate<T>(acc[r][1], part[r][1], s1);
          part[r][0] = part[r][1] = 0.f;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kW4SimtRows; ++r) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float v = acc[r][j];
      v += __shfl_xor_sync(kFullMask, v, 1);
      v += __shfl_xor_sync(kFullMask, v, 2);
      if (t == 0) w4_store<T>(out, partial, bias, row0 + r, n0 + 8 * j + g, m, n, has_bias, v);
    }
  }
}

// Split-K: out[i] = sum over splits of partial[split][i] (+ bias), in T. One thread per output.
template <typename T>
__global__ void __launch_bounds__(256) gemm_w4a16_reduce(
    const float* __restrict__ partial, const T* __restrict__ bias, T* __restrict__ out, int m,
    int n, int splits, int has_bias) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long total = static_cast<long long>(m) * n;
  if (i >= total) return;
  float v = 0.f;
  for (int z = 0; z < splits; ++z) v += partial[z * total + i];
  out[i] = from_float<T>(has_bias ? v + to_float(bias[i % n]) : v);
}
