"""Where kernels run: on a GPU through CuPy, or on the CPU through the emulator. Both take the
same launches from kernels.ops; only how a tensor becomes a kernel argument, where scratch
memory comes from and the launch stream differ."""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from noria.kernels.instances import ModuleSpec
from noria.kernels.options import SOURCE_DIR, compile_options, read_source

Kernel = Callable[..., None]

# Stand-in SM count for launch heuristics off the GPU (an H100 SXM has 132).
DEFAULT_SM_COUNT = 132


class KernelBackend(ABC):
    def __init__(self, source_dir: Path = SOURCE_DIR) -> None:
        self.source_dir = Path(source_dir)

    @abstractmethod
    def kernel(self, spec: ModuleSpec, name: str) -> Kernel: ...

    @abstractmethod
    def ptr(self, t: torch.Tensor) -> Any:
        """The kernel argument for a pointer to t's first element."""

    @abstractmethod
    def pointer_table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """An int64 tensor on `device` holding the tensors' base addresses."""

    @property
    @abstractmethod
    def sm_count(self) -> int: ...

    def scratch(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=torch.float32, device=device)

    def launch_context(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def check(self) -> None:
        """Raise if this backend cannot run kernels here (start-up check; the default: it can)."""
        return None


class CupyBackend(KernelBackend):
    """Runs on the current CUDA device and torch's current stream."""

    def kernel(self, spec: ModuleSpec, name: str) -> Kernel:
        from noria.kernels.loader import cupy_kernel

        return cupy_kernel(spec, name, self.source_dir)

    def ptr(self, t: torch.Tensor) -> Any:
        # CuPy packs a numpy scalar by value: 8 bytes, exactly a pointer parameter. This
        # avoids wrapping every tensor in a cupy.ndarray (and any stream sync that implies).
        return np.uint64(t.data_ptr())

    def pointer_table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        for t in tensors:
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError("a CPU cache used by a GPU copy must be in pinned memory")
        return _cached_pointer_table(tuple(t.data_ptr() for t in tensors), str(device))

    @functools.cached_property
    def sm_count(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def check(self) -> None:
        """CuPy imports, sees a device and loads NVRTC: what a missing or broken install
        (no wheel, a wheel for another CUDA major, no NVRTC library) gets wrong first."""
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
        cupy.cuda.nvrtc.getVersion()

    @contextlib.contextmanager
    def launch_context(self, device: torch.device) -> Iterator[None]:
        import cupy

        with cupy.cuda.Device(device.index or 0):
            stream = torch.cuda.current_stream(device)
            with cupy.cuda.ExternalStream(stream.cuda_stream, device.index or 0):
                yield


@functools.lru_cache(maxsize=64)
def _cached_pointer_table(addresses: tuple[int, ...], device: str) -> torch.Tensor:
    # The caches live as long as the worker, so their addresses are stable across steps.
    return torch.tensor(list(addresses), dtype=torch.int64).to(device)


class EmuBackend(KernelBackend):
    """Runs the unchanged .cu sources on the CPU (tests). Tensors must be CPU tensors.
    Scratch memory is NaN-filled so that a kernel reading what it never wrote shows up."""

    def __init__(self, source_dir: Path = SOURCE_DIR, config: Any = None) -> None:
        super().__init__(source_dir)
        from noria.kernels.emu import EmuConfig

        self.config = config or EmuConfig.from_env()

    def kernel(self, spec: ModuleSpec, name: str) -> Kernel:
        if name not in spec.names:
            raise KeyError(f"{name} is not instantiated by {spec}")
        module = _emu_module(spec, self.source_dir)
        kern = module.get_function(name)
        config = self.config

        def launch(grid: Any, block: Any, args: Sequence[Any], shared_mem: int = 0) -> None:
            kern(grid, block, args, shared_mem=shared_mem, config=config)

        return launch

    def ptr(self, t: torch.Tensor) -> Any:
        if t.device.type != "cpu":
            raise ValueError("the CPU emulator needs CPU tensors")
        from noria.kernels.emu.memcheck import tensor_view

        storage = t.untyped_storage()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)  # numpy has no bfloat16; only the address matters
        elif t.dtype == torch.float8_e4m3fn:
            t = t.view(torch.uint8)  # nor fp8
        # The storage's extent lets the memory check tell a read past a strided slice (a query
        # slice of a fused QKV row) from a read of some other allocation.
        return tensor_view(t.detach().numpy(), storage.data_ptr(), storage.nbytes())

    def pointer_table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

    @property
    def sm_count(self) -> int:
        return DEFAULT_SM_COUNT

    def scratch(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.full(tuple(shape), float("nan"), dtype=torch.float32)

    def prebuild(self, specs: Sequence[ModuleSpec]) -> None:
        """Compile modules ahead of use (g++ runs in parallel threads)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda s: _emu_module(s, self.source_dir).compile(), specs))


@functools.cache
def _emu_module(spec: ModuleSpec, source_dir: Path) -> Any:
    from noria.kernels.emu import EmuRawModule

    return EmuRawModule(
        code=read_source(spec.source, source_dir),
        options=compile_options(source_dir),
        name_expressions=spec.names,
        source_name=spec.source,
    )


_DEFAULT_CUDA: CupyBackend | None = None


def default_backend(device: torch.device) -> KernelBackend:
    """CUDA tensors run through CuPy; CPU tensors through the emulator."""
    global _DEFAULT_CUDA
    if device.type == "cuda":
        if _DEFAULT_CUDA is None:
            _DEFAULT_CUDA = CupyBackend()
        return _DEFAULT_CUDA
    return EmuBackend()
