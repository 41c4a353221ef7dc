"""Python side of the emulator's memory check (include/cudaemu/memcheck.h): the module's
thread-local symbols (its __shared__ variables, found in the ELF symbol table) and each
launch's pointer arguments as strided views, in the C structs the hooks read."""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MAX_DIMS = 6


GLOBAL_GUARD = 8  # kGlobalGuard in memcheck.h


class MemArg(ctypes.Structure):
    _fields_ = [
        ("near_lo", ctypes.c_uint64),
        ("near_hi", ctypes.c_uint64),
        ("span_hi", ctypes.c_uint64),
        ("contiguous", ctypes.c_int64),
        ("base", ctypes.c_uint64),
        ("itemsize", ctypes.c_uint64),
        ("ndim", ctypes.c_int64),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("name", ctypes.c_char_p),
    ]


class TensorView(np.ndarray):
    """A numpy view of a tensor that also knows the allocation (torch storage) it lies in."""

    region: tuple[int, int] | None = None


def tensor_view(arr: np.ndarray, storage_ptr: int, storage_bytes: int) -> np.ndarray:
    view = arr.view(TensorView)
    view.region = (storage_ptr, storage_ptr + storage_bytes)
    return view


class MemVar(ctypes.Structure):
    _fields_ = [
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("name", ctypes.c_char_p),
        ("dynamic", ctypes.c_int64),
    ]


# readelf -sW: "Num: Value Size Type Bind Vis Ndx Name"; sizes of 100000 and up print in hex.
_SYMBOL = re.compile(r"^\s*\d+:\s+([0-9a-fA-F]+)\s+(0x[0-9a-fA-F]+|\d+)\s+TLS\s+\S+\s+\S+\s+\S+\s+(.+)$")


def _short(demangled: str) -> str:
    """`f<float, 64>(float*, int)::q_s` -> `q_s (in f<float, 64>)`."""
    func, sep, var = demangled.rpartition(")::")
    if not sep:
        return demangled
    return f"{var} (in {func.split('(')[0]})"


@functools.cache
def tls_symbols(path: Path) -> tuple[tuple[int, int, str], ...]:
    """(offset in the TLS segment, size, readable name) of every thread-local symbol."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise RuntimeError("the emulator's memory check needs readelf (binutils)")
    out = subprocess.run([readelf, "-sW", "-C", str(path)], capture_output=True, text=True, check=True)
    found: dict[int, tuple[int, int, str]] = {}
    for line in out.stdout.splitlines():
        m = _SYMBOL.match(line)
        if m and int(m.group(2), 0) > 0:
            off = int(m.group(1), 16)
            found.setdefault(off, (off, int(m.group(2), 0), _short(m.group(3).strip())))
    return tuple(sorted(found.values()))


def var_table(path: Path, dynamic_names: Sequence[str]) -> Any:
    """The MemVar array for cudaemu_set_vars; the caller keeps it alive with the library."""
    syms = tls_symbols(path)
    table = (MemVar * max(1, len(syms)))()
    for i, (off, size, name) in enumerate(syms):
        table[i] = MemVar(off, size, name.encode(), int(name in dynamic_names))
    return table, len(syms)


def arg_table(kinds: str, args: Sequence[Any], names: Sequence[str]) -> tuple[Any, int]:
    """A MemArg per pointer argument (a numpy array: its data pointer, shape and strides)."""
    views = [(i, a) for i, (k, a) in enumerate(zip(kinds, args, strict=True)) if k == "p"]
    table = (MemArg * max(1, len(views)))()
    for j, (i, a) in enumerate(views):
        arr: np.ndarray = a
        name = names[i] if i < len(names) and names[i] else f"#{i}"
        # Outermost first (the C side peels dimensions off by decreasing stride).
        dims = sorted(zip(arr.shape, arr.strides, strict=True), key=lambda d: -d[1])
        shape, strides = tuple(d[0] for d in dims), tuple(d[1] for d in dims)
        if arr.ndim > MAX_DIMS or any(s < 0 for s in strides):
            shape, strides = (arr.size,), (arr.itemsize,)  # coarse: the flat extent
        base = arr.ctypes.data
        span_hi = base if arr.size == 0 else base + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + arr.itemsize
        lo, hi = getattr(arr, "region", None) or (base, span_hi)  # region: EmuBackend.ptr
        table[j].base = base
        table[j].span_hi = span_hi
        table[j].contiguous = int(arr.flags.c_contiguous)
        table[j].near_lo = max(0, min(lo, base) - GLOBAL_GUARD)
        table[j].near_hi = max(hi, span_hi) + GLOBAL_GUARD
        table[j].itemsize = arr.itemsize
        table[j].ndim = len(shape)
        for d, (n, s) in enumerate(zip(shape, strides, strict=True)):
            table[j].shape[d], table[j].strides[d] = n, s
        table[j].name = name.encode()
    return table, len(views)
