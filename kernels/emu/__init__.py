"""CPU emulation of CUDA kernels: the unchanged .cu sources are compiled with g++ against a
header-only runtime (include/cudaemu.h) that runs each CUDA thread as a fiber."""

from noria.kernels.emu.build import EmuBuildError
from noria.kernels.emu.module import (
    SCHEDULES,
    EmuConfig,
    EmuKernel,
    EmuKernelError,
    EmuLaunchError,
    EmuRawModule,
)

__all__ = [
    "SCHEDULES",
    "EmuBuildError",
    "EmuConfig",
    "EmuKernel",
    "EmuKernelError",
    "EmuLaunchError",
    "EmuRawModule",
]
