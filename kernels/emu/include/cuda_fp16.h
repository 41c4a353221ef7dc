// Stand-in for CUDA's cuda_fp16.h under the CPU emulator.
#pragma once
#include "cudaemu/half.h"
