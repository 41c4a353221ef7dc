// Force-included (g++ -include cudaemu.h) before every .cu file that runs under the CPU
// emulator. The .cu sources stay unchanged: CUDA keywords become plain C++, built-ins read
// the current fiber, and intrinsics talk to the block scheduler.
#pragma once

#include "cudaemu/keywords.h"
#include "cudaemu/types.h"
#include "cudaemu/half.h"
#include "cudaemu/runtime.h"
#include "cudaemu/collectives.h"
#include "cudaemu/intrinsics.h"
#include "cudaemu/memcheck.h"
#include "cudaemu/tensor_core.h"
