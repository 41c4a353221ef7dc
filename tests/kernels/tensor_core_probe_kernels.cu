// Small kernels over kernels/csrc/tensor_core.cuh (tests/kernels/test_emu_tensor_core.py):
// they run under the CPU emulator and compile with NVRTC for sm_80 / sm_90, so the same text
// checks the emulator's model of each instruction and the validity of the inline PTX.
#include "tensor_core.cuh"

using noria::cp_async_16;

// One m16n8k16 per warp; every lane loads its own registers in PTX fragment order.
// a: [warps][32][4], b: [warps][32][2], c, d: [warps][32][4].
extern "C" __global__ void mma_k16(const unsigned* a, const unsigned* b, const float* c, float* d,
                                   int bf16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned ra[4], rb[2];
  float rc[4], rd[4];
  for (int k = 0; k < 4; ++k) ra[k] = a[4 * i + k];
  for (int k = 0; k < 2; ++k) rb[k] = b[2 * i + k];
  for (int k = 0; k < 4; ++k) rc[k] = c[4 * i + k];
  if (bf16)
    noria::mma_m16n8k16_bf16(rd, ra, rb, rc);
  else
    noria::mma_m16n8k16_f16(rd, ra, rb, rc);
  for (int k = 0; k < 4; ++k) d[4 * i + k] = rd[k];
}

// m16n8k8: a: [warps][32][2], b: [warps][32][1].
extern "C" __global__ void mma_k8(const unsigned* a, const unsigned* b, const float* c, float* d,
                                  int bf16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned ra[2], rb[1];
  float rc[4], rd[4];
  for (int k = 0; k < 2; ++k) ra[k] = a[2 * i + k];
  rb[0] = b[i];
  for (int k = 0; k < 4; ++k) rc[k] = c[4 * i + k];
  if (bf16)
    noria::mma_m16n8k8_bf16(rd, ra, rb, rc);
  else
    noria::mma_m16n8k8_f16(rd, ra, rb, rc);
  for (int k = 0; k < 4; ++k) d[4 * i + k] = rd[k];
}

// tile: 32 rows of 8 b16 elements, staged in shared memory; lane l supplies the address of
// row row_of_lane[l]. out: [32][4] registers.
extern "C" __global__ void ldmatrix_probe(const unsigned short* tile, const int* row_of_lane,
                                          unsigned* out, int num, int trans) {
  __shared__ __align__(16) unsigned short tile_s[32 * 8];
  const int lane = threadIdx.x;
  for (int k = 0; k < 8; ++k) tile_s[lane * 8 + k] = tile[lane * 8 + k];
  __syncwarp();
  const unsigned short* row = &tile_s[row_of_lane[lane] * 8];
  unsigned r[4] = {0u, 0u, 0u, 0u};
  if (num == 1 && !trans) noria::ldmatrix_x1(r, row);
  if (num == 2 && !trans) noria::ldmatrix_x2(r, row);
  if (num == 4 && !trans) noria::ldmatrix_x4(r, row);
  if (num == 1 && trans) noria::ldmatrix_x1_trans(r, row);
  if (num == 2 && trans) noria::ldmatrix_x2_trans(r, row);
  if (num == 4 && trans) noria::ldmatrix_x4_trans(r, row);
  for (int k = 0; k < 4; ++k) out[lane * 4 + k] = r[k];
}

// The pattern a tensor-core kernel uses, for one warp: A (16 x 16, row-major) and B (16 x 8,
// row-major: row k holds B[k][0..7]) copied global -> shared with cp.async, A read with
// ldmatrix.x4 and B with ldmatrix.x2.trans, D = A B (+ 0) with one mma; d: [16][8].
template <typename T>
__device__ __forceinline__ void tile_gemm(const T* a, const T* b, float* d) {
  __shared__ __align__(16) T a_s[16 * 16];
  __shared__ __align__(16) T b_s[16 * 8];
  const int lane = threadIdx.x;
  cp_async_16(&a_s[lane * 8], &a[lane * 8]);  // 32 chunks of 8 elements: all of A
  if (lane < 16) cp_async_16(&b_s[lane * 8], &b[lane * 8]);
  noria::cp_async_commit();
  noria::cp_async_wait<0>();
  __syncthreads();
  unsigned ra[4], rb[2];
  noria::ldmatrix_x4(ra, &a_s[(lane % 16) * 16 + (lane / 16) * 8]);
  noria::ldmatrix_x2_trans(rb, &b_s[(lane % 16) * 8]);
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float rd[4];
  noria::mma_m16n8k16<T>(rd, ra, rb, zero);
  const int g = lane / 4, t = lane % 4;
  d[g * 8 + 2 * t] = rd[0];
  d[g * 8 + 2 * t + 1] = rd[1];
  d[(g + 8) * 8 + 2 * t] = rd[2];
  d[(g + 8) * 8 + 2 * t + 1] = rd[3];
}

extern "C" __global__ void tile_gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                          float* d) {
  tile_gemm(a, b, d);
}

extern "C" __global__ void tile_gemm_f16(const __half* a, const __half* b, float* d) {
  tile_gemm(a, b, d);
}

// Two commit groups per thread: group 0 (16 bytes, .cg) must have landed after
// cp_async_wait<1>, group 1 (.ca 8 and 4 bytes, a zero-filled 16) after cp_async_wait<0>;
// then every thread reads its neighbour's data after a barrier. src: [1024] floats,
// out: [blockDim][12].
extern "C" __global__ void cp_async_groups(const float* src, float* out) {
  __shared__ __align__(16) float a_s[128 * 4];
  __shared__ __align__(16) float b_s[128 * 2];
  __shared__ __align__(16) float c_s[128];
  __shared__ __align__(16) float z_s[128 * 4];
  const int t = threadIdx.x;
  const int n = blockDim.x;
  cp_async_16(&a_s[4 * t], &src[4 * t]);
  noria::cp_async_commit();
  noria::cp_async_ca<8>(&b_s[2 * t], &src[512 + 2 * t]);
  noria::cp_async_ca<4>(&c_s[t], &src[768 + t]);
  noria::cp_async_16_zfill(&z_s[4 * t], &src[4 * t], 4 * (t % 5));  // 0..16 bytes read
  noria::cp_async_commit();
  noria::cp_async_wait<1>();
  for (int k = 0; k < 4; ++k) out[12 * t + k] = a_s[4 * t + k];
  noria::cp_async_wait<0>();
  __syncthreads();
  const int u = (t + 1) % n;  // written by another thread
  out[12 * t + 4] = b_s[2 * u];
  out[12 * t + 5] = b_s[2 * u + 1];
  out[12 * t + 6] = c_s[u];
  out[12 * t + 7] = 0.0f;
  for (int k = 0; k < 4; ++k) out[12 * t + 8 + k] = z_s[4 * u + k];
}

// cp_async_wait_all commits the open group itself.
extern "C" __global__ void cp_async_wait_all_probe(const float* src, float* out) {
  __shared__ __align__(16) float s[128 * 4];
  const int t = threadIdx.x;
  cp_async_16(&s[4 * t], &src[4 * t]);
  noria::cp_async_wait_all();
  for (int k = 0; k < 4; ++k) out[4 * t + k] = s[4 * t + k];
}

// Lanes 16-31 leave before the warp's mma.
extern "C" __global__ void mma_after_partial_exit(float* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  unsigned a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4];
  noria::mma_m16n8k16_bf16(d, a, b, c);
  out[lane] = d[0];
}

// Both halves of the warp issue an mma, from two different places.
extern "C" __global__ void mma_in_divergent_branches(float* out) {
  const int lane = threadIdx.x % 32;
  unsigned a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4];
  if (lane < 16) {
    noria::mma_m16n8k16_bf16(d, a, b, c);
  } else {
    noria::mma_m16n8k16_bf16(d, a, b, c);
  }
  out[lane] = d[0];
}

// Half the warp at an mma, the other half at an ldmatrix.
extern "C" __global__ void mma_meets_ldmatrix(float* out) {
  __shared__ __align__(16) unsigned short s[8 * 8];
  const int lane = threadIdx.x % 32;
  for (int k = 0; k < 2; ++k) s[lane * 2 + k] = 0;
  __syncwarp();
  unsigned a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (lane < 16)
    noria::mma_m16n8k16_bf16(d, a, b, c);
  else
    noria::ldmatrix_x4(a, &s[(lane % 8) * 8]);
  out[lane] = d[0] + static_cast<float>(a[0]);
}

// ldmatrix row addresses that a GPU rejects or reads wrongly: mode 0 a global address,
// mode 1 a row one past the end of the shared tile, mode 2 an address 8 bytes off alignment.
extern "C" __global__ void ldmatrix_bad_address(const unsigned short* g, unsigned* out, int mode) {
  __shared__ __align__(16) unsigned short s[8 * 8];
  const int lane = threadIdx.x % 32;
  for (int k = 0; k < 2; ++k) s[lane * 2 + k] = 0;
  __syncwarp();
  const unsigned short* row = &s[(lane % 8) * 8];
  if (mode == 0) row = &g[(lane % 8) * 8];
  if (mode == 1) row = &s[((lane % 8) + 1) * 8];  // lane 7: row 8, past the end
  if (mode == 2) row = &s[(lane % 8) * 8 + 4];
  unsigned r[1];
  noria::ldmatrix_x1(r, row);
  out[lane] = r[0];
}
