// Small kernels that pin down the emulator's semantics (tests/kernels/test_emu_*.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" __global__ void to_half_and_back(const float* in, float* out, unsigned short* bits, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const __half h = __float2half_rn(in[i]);
    bits[i] = __half_as_ushort(h);
    out[i] = __half2float(h);
  }
}

extern "C" __global__ void to_bf16(const float* in, unsigned short* bits, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) bits[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

// op: 0 idx, 1 up, 2 down, 3 xor; param per lane from params[lane].
extern "C" __global__ void shuffle(const int* params, int* out, int op, int width) {
  const int lane = threadIdx.x;
  const int v = 100 + lane;
  int r = 0;
  switch (op) {
    case 0: r = __shfl_sync(0xffffffffu, v, params[lane], width); break;
    case 1: r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(params[lane]), width); break;
    case 2: r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(params[lane]), width); break;
    default: r = __shfl_xor_sync(0xffffffffu, v, params[lane], width); break;
  }
  out[lane] = r;
}

extern "C" __global__ void votes(const int* pred, unsigned* out) {
  const int lane = threadIdx.x;
  const unsigned b = __ballot_sync(0xffffffffu, pred[lane]);
  const int any = __any_sync(0xffffffffu, pred[lane]);
  const int all = __all_sync(0xffffffffu, pred[lane]);
  const unsigned sum = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(pred[lane] * lane));
  const int mn = __reduce_min_sync(0xffffffffu, pred[lane] ? lane - 7 : 100);
  if (lane == 0) {
    out[0] = b;
    out[1] = any;
    out[2] = all;
    out[3] = sum;
    out[4] = static_cast<unsigned>(mn);
  }
}

extern "C" __global__ void barrier_counts(const int* pred, int* out) {
  const int t = threadIdx.x;
  const int c = __syncthreads_count(pred[t]);
  const int a = __syncthreads_and(pred[t]);
  const int o = __syncthreads_or(pred[t]);
  out[3 * t] = c;
  out[3 * t + 1] = a;
  out[3 * t + 2] = o;
}

extern "C" __global__ void count_atomically(unsigned long long* counter, float* fsum) {
  atomicAdd(counter, 1ull);
  atomicAdd(fsum, 1.0f);
}

// Each block stages its own index in shared memory: blocks must not see each other's.
extern "C" __global__ void block_private_shared(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = blockIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void coordinates(int* out) {
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int i = b * blockDim.x * blockDim.y * blockDim.z + t;
  out[4 * i] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z;
  out[4 * i + 1] = blockIdx.x + 10 * blockIdx.y + 100 * blockIdx.z;
  out[4 * i + 2] = blockDim.x + 10 * blockDim.y + 100 * blockDim.z;
  out[4 * i + 3] = gridDim.x + 10 * gridDim.y + 100 * gridDim.z;
}

// Reverses a block's values through shared memory; `sync` = 0 drops the barrier.
extern "C" __global__ void reverse_through_shared(const float* in, float* out, int sync) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = in[t];
  if (sync) __syncthreads();
  out[t] = s[blockDim.x - 1 - t];
}

// Warp-synchronous tree reduction in shared memory without __syncwarp: correct only under
// implicit lock-step, which Volta and later do not promise.
extern "C" __global__ void warp_sum_without_syncwarp(const float* in, float* out, int use_syncwarp) {
  __shared__ float s[32];
  const int t = threadIdx.x;
  s[t] = in[t];
  if (use_syncwarp) __syncwarp();
  for (int o = 16; o > 0; o >>= 1) {
    float v = 0.0f;
    if (t < o) v = s[t] + s[t + o];
    if (use_syncwarp) __syncwarp();
    if (t < o) s[t] = v;
    if (use_syncwarp) __syncwarp();
  }
  if (t == 0) out[0] = s[0];
}

extern "C" __global__ void read_unwritten_shared(float* out) {
  __shared__ float s[64];
  if (threadIdx.x < 32) s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

extern "C" __global__ void dynamic_shared(float* out, int n) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* s = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = static_cast<float>(i);
  __syncthreads();
  out[threadIdx.x] = s[n - 1 - threadIdx.x];
}

extern "C" __global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void return_before_barrier(float* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shuffle_outside_mask(int* out) {
  const int lane = threadIdx.x;
  if (lane < 16) out[lane] = __shfl_sync(0x0000ffffu, lane, 20);
}

extern "C" __global__ void mixed_collectives(int* out) {
  const int lane = threadIdx.x;
  if (lane < 16) out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);
  else out[lane] = static_cast<int>(__ballot_sync(0xffffffffu, 1));
}

extern "C" __global__ void half_warp_groups(int* out) {
  // Two disjoint half-warp collectives in flight at once are legal CUDA.
  const int lane = threadIdx.x;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  out[lane] = __shfl_xor_sync(mask, lane, 1);
}

extern "C" __global__ void partial_warp_full_mask(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

extern "C" __global__ void takes_scalars(float* out, int i, float f, long long l) {
  out[0] = static_cast<float>(i) + f + static_cast<float>(l);
}

extern "C" __global__ void traps(float* out) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = 0.0f;
}

// Memory checking: `extra` elements past the end of a shared array or of a pointer argument.
extern "C" __global__ void shared_past_end(float* out, int extra) {
  __shared__ float first[32];
  __shared__ float second[32];
  for (int i = threadIdx.x; i < 32 + extra; i += blockDim.x) first[i] = 1.0f;
  second[threadIdx.x] = 2.0f;
  __syncthreads();
  out[threadIdx.x] = first[threadIdx.x] + second[threadIdx.x];
}

extern "C" __global__ void copy_with_overrun(const float* in, float* out, int n_in, int n_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_out) out[i] = i < n_in ? in[i] : 0.0f;
}

extern "C" __global__ void dynamic_past_launch_size(float* out, int n) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  float* s = reinterpret_cast<float*>(dyn_smem);
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}
