// CUDA C++ keywords mapped onto plain C++ so that unchanged .cu files compile with g++.
#pragma once

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __constant__
#define __managed__

// One OS thread runs one block at a time, so thread-local storage gives every running
// block its own copy of each __shared__ variable; the runtime poisons that storage at
// every block start so that reads of unwritten shared memory show up as NaN / -1.
#define __shared__ thread_local

#define CUDAEMU 1
