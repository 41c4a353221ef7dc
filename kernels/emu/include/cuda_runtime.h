// Stand-in for CUDA's cuda_runtime.h under the CPU emulator: everything lives in cudaemu.h.
#pragma once
#include "cudaemu.h"
