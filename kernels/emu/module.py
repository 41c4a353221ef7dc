"""`EmuRawModule`: cupy.RawModule's shape (code, options, name_expressions, get_function,
kernel(grid, block, args, shared_mem=)) over the CPU emulator.

Arguments are checked against the C++ parameter list the way a GPU would silently not:
numpy arrays go to pointer parameters, numpy scalars must have the parameter's exact size,
and a Python int or float is rejected for a 4-byte parameter because CuPy passes those as
8-byte values.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from noria.kernels.emu import build, memcheck, wrapper

SCHEDULES = ("forward", "reverse", "greedy", "greedy-reverse", "random")
_POLICY = {name: i for i, name in enumerate(SCHEDULES)}
DEFAULT_SMEM_LIMIT = 48 * 1024  # without the max_dynamic_shared_size_bytes opt-in


class EmuKernelError(RuntimeError):
    """The kernel did something a GPU would hang on or give undefined results for."""


class EmuLaunchError(ValueError):
    """The launch itself is invalid (grid, block, shared memory or arguments)."""


@dataclass(frozen=True)
class EmuConfig:
    """How blocks are run. `schedule` is the order in which a block's runnable threads are
    resumed: forward/reverse round-robin, greedy(-reverse) lets the lowest (highest) warp run
    ahead, random[:seed] picks at random."""

    schedule: str = "forward"
    workers: int = 1
    strict: bool = True
    # Bounds-check every access to __shared__ variables and pointer arguments (memcheck.h).
    memcheck: bool = True

    @staticmethod
    def from_env() -> EmuConfig:
        return EmuConfig(
            schedule=os.environ.get("CUDAEMU_SCHEDULE", "forward"),
            workers=int(os.environ.get("CUDAEMU_WORKERS", str(min(2, os.cpu_count() or 1)))),
            strict=os.environ.get("CUDAEMU_STRICT", "1") != "0",
            memcheck=os.environ.get("CUDAEMU_MEMCHECK", "1") != "0",
        )

    def policy(self) -> tuple[int, int]:
        name, _, seed = self.schedule.partition(":")
        if name not in _POLICY:
            raise ValueError(f"unknown schedule {self.schedule!r}; one of {SCHEDULES}")
        return _POLICY[name], int(seed or 0)


_LIBS: dict[Path, ctypes.CDLL] = {}
_LIBS_LOCK = threading.Lock()
_VARS: dict[Path, Any] = {}  # per library: the MemVar table it points to


def _load(path: Path) -> ctypes.CDLL:
    with _LIBS_LOCK:
        lib = _LIBS.get(path)
        if lib is None:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
            lib.cudaemu_kernel_count.restype = ctypes.c_int
            lib.cudaemu_kernel_name.restype = ctypes.c_char_p
            lib.cudaemu_kernel_kinds.restype = ctypes.c_char_p
            lib.cudaemu_kernel_sizes.restype = ctypes.POINTER(ctypes.c_ushort)
            lib.cudaemu_launch.restype = ctypes.c_int
            lib.cudaemu_launch.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_ulonglong,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_int,
                ctypes.c_ulonglong,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_size_t,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
            ]
            lib.cudaemu_set_vars.restype = None
            lib.cudaemu_set_vars.argtypes = [ctypes.c_void_p, ctypes.c_int]
            _LIBS[path] = lib
        return lib


def _parse_options(options: Sequence[str]) -> tuple[list[Path], list[str]]:
    includes: list[Path] = []
    defines: list[str] = []
    it = iter(options)
    for opt in it:
        if opt in ("-I", "--include-path"):
            includes.append(Path(next(it)))
        elif opt.startswith("--include-path="):
            includes.append(Path(opt.split("=", 1)[1]))
        elif opt.startswith("-I"):
            includes.append(Path(opt[2:]))
        elif opt in ("-D", "--define-macro"):
            defines.append(next(it))
        elif opt.startswith("-D"):
            defines.append(opt[2:])
        # Code-generation options (-std, -arch, -Xptxas, ...) have no CPU meaning.
    return includes, defines


def _dims(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int | np.integer) else tuple(v)
    if not 1 <= len(t) <= 3:
        raise EmuLaunchError(f"grid/block must have 1 to 3 dimensions, got {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    return t  # type: ignore[return-value]


_UNSIGNED = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}


def _pack(index: int, kind: str, size: int, arg: Any) -> ctypes._SimpleCData:
    where = f"argument {index}"
    if kind == "p":
        if not isinstance(arg, np.ndarray):
            raise TypeError(f"{where}: pointer parameter needs a numpy array, got {type(arg)}")
        return ctypes.c_void_p(arg.ctypes.data)
    if isinstance(arg, np.ndarray):
        raise TypeError(f"{where}: array passed to a {size}-byte scalar parameter")
    if isinstance(arg, bool | np.bool_):
        value = np.bool_(arg)
    elif isinstance(arg, int):
        value = np.int64(arg)  # what CuPy passes for a Python int
    elif isinstance(arg, float):
        value = np.float64(arg)  # what CuPy passes for a Python float
    elif isinstance(arg, np.generic):
        value = arg
    else:
        raise TypeError(f"{where}: unsupported argument type {type(arg)}")
    vkind = {"b": "b", "f": "f", "i": "i", "u": "u"}.get(value.dtype.kind, "?")
    if value.dtype.itemsize != size or (vkind != kind and {vkind, kind} != {"i", "u"}):
        raise TypeError(
            f"{where}: parameter is a {size}-byte '{kind}' but got {value.dtype} "
            f"({value.dtype.itemsize} bytes); a GPU would read garbage"
        )
    return _UNSIGNED[size].from_buffer_copy(value.tobytes())


class EmuKernel:
    """One kernel of an emulated module; call it like cupy.RawKernel."""

    def __init__(self, module: EmuRawModule, index: int, name: str, kinds: str, sizes: list[int]):
        self._module = module
        self._index = index
        self.name = name
        self.kinds = kinds
        self.sizes = sizes
        self.max_dynamic_shared_size_bytes = 0

    def __call__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
        config: EmuConfig | None = None,
    ) -> None:
        cfg = config or self._module.config
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.name}: {len(self.kinds)} parameters, {len(args)} arguments")
        limit = max(DEFAULT_SMEM_LIMIT, self.max_dynamic_shared_size_bytes)
        if shared_mem > limit:
            raise EmuLaunchError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory need "
                f"max_dynamic_shared_size_bytes >= {shared_mem} (now {limit})"
            )
        packed = [
            _pack(i, k, s, a)
            for i, (k, s, a) in enumerate(zip(self.kinds, self.sizes, args, strict=True))
        ]
        argv = (ctypes.c_void_p * max(1, len(packed)))(*(ctypes.addressof(p) for p in packed))
        g = (ctypes.c_uint * 3)(*_dims(grid))
        b = (ctypes.c_uint * 3)(*_dims(block))
        policy, seed = cfg.policy()
        err = ctypes.create_string_buffer(4096)
        lib = self._module._lib()
        margs, nmargs = memcheck.arg_table(self.kinds, args, self._module.param_names(self.name))
        # Arrays must outlive the call; `args` holds them until we return.
        with self._module._launch_lock:
            rc = lib.cudaemu_launch(
                self._index,
                g,
                b,
                int(shared_mem),
                argv,
                policy,
                seed,
                cfg.workers,
                int(cfg.strict),
                err,
                len(err),
                ctypes.cast(margs, ctypes.c_void_p),
                nmargs,
                int(cfg.memcheck),
            )
        if rc == 1:
            raise EmuKernelError(f"{self.name}: {err.value.decode()}")
        if rc != 0:
            raise EmuLaunchError(f"{self.name}: {err.value.decode()}")


class EmuRawModule:
    """cupy.RawModule(code=, options=, name_expressions=) compiled with g++ for the CPU."""

    def __init__(
        self,
        *,
        code: str,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] | None = None,
        config: EmuConfig | None = None,
        source_name: str = "kernel.cu",
    ) -> None:
        self.code = code
        self.options = tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self.config = config or EmuConfig.from_env()
        self._source_name = source_name
        self._names = list(self.name_expressions) + [
            n for n in wrapper.extern_c_kernels(code) if n not in self.name_expressions
        ]
        self._path: Path | None = None
        self._launch_lock = threading.Lock()
        self._params: dict[str, list[str]] = {}

    def with_config(self, **changes: Any) -> EmuRawModule:
        clone = EmuRawModule(
            code=self.code,
            options=self.options,
            name_expressions=self.name_expressions,
            config=replace(self.config, **changes),
            source_name=self._source_name,
        )
        clone._path = self._path
        return clone

    def compile(self) -> Path:
        if self._path is None:
            includes, defines = _parse_options(self.options)
            text = wrapper.generate(self.code, self._names, self._source_name)
            self._path = build.build(text, includes, defines)
        return self._path

    def _lib(self) -> ctypes.CDLL:
        path = self.compile()
        lib = _load(path)
        with _LIBS_LOCK:
            if path not in _VARS:  # the __shared__ variables' spans, for memcheck.h
                dynamic = [a.name for a in wrapper.dynamic_shared_arrays(self.code)]
                table, n = memcheck.var_table(path, dynamic)
                lib.cudaemu_set_vars(ctypes.cast(table, ctypes.c_void_p), n)
                _VARS[path] = table
        return lib

    def param_names(self, name: str) -> list[str]:
        if name not in self._params:
            self._params[name] = wrapper.kernel_param_names(self.code, name)
        return self._params[name]

    def get_function(self, name: str) -> EmuKernel:
        if name not in self._names:
            raise KeyError(f'{name!r} is neither a name expression nor an extern "C" kernel')
        lib = self._lib()
        index = self._names.index(name)
        kinds = lib.cudaemu_kernel_kinds(index).decode()
        sizes_ptr = lib.cudaemu_kernel_sizes(index)
        return EmuKernel(self, index, name, kinds, [sizes_ptr[i] for i in range(len(kinds))])
