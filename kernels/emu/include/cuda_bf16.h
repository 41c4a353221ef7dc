// Stand-in for CUDA's cuda_bf16.h under the CPU emulator.
#pragma once
#include "cudaemu/half.h"
