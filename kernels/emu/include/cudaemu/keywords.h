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
// Each variable is aligned to 64 KB (above any static array, 48 KB at most): the bytes past
// its end are padding that belongs to no variable, which memcheck.h reports when touched.
#define CUDAEMU_SHARED_ALIGN 65536
#define __shared__ thread_local __attribute__((aligned(CUDAEMU_SHARED_ALIGN)))

// The emulator's own functions (scheduler, fibers, launch) are not memory-checked: their
// loads and stores would only cost time (memcheck.h checks the kernels' accesses).
#define CUDAEMU_RUNTIME __attribute__((no_sanitize_address))

#define CUDAEMU 1
