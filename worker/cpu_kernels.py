"""Native CPU kernels for the torch backend, compiled with the system C compiler.

A small C file (worker/csrc) is built once per content hash into the noria
cache and called through ctypes on tensors' data pointers: no torch headers,
so the build takes about a second. If no compiler works, `load()` returns
None and the backend keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("noria.worker")

_SRC = Path(__file__).parent / "csrc" / "paged_decode.c"
# Reassociation lets the dot products vectorize and no errno lets expf use the vector
# math library; nothing else of -ffast-math.
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cache_dir() -> Path:
    base = os.environ.get("NORIA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "noria"
    )
    return Path(base) / "cpu-kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: -march=native code built on an AVX-512 host must not be
    loaded from a shared cache folder on an AVX2-only one (illegal instruction)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        import platform

        return platform.processor().encode()


@cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("NORIA_DISABLE_CPU_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    lib = _cache_dir() / f"paged_decode-{digest}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
                pass
            subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp.name, "-lm"], check=True, capture_output=True)
            os.replace(tmp.name, lib)  # atomic: concurrent workers never load half a file
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("CPU kernels unavailable, using the torch path: %s", e)
        return None
    fn = dll.paged_decode_f32
    # Pointers travel as plain ints (data_ptr()): cheaper per call than ctypes.cast.
    fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                   ctypes.c_float, _I64, ctypes.c_int, _PTR, _PTR, _PTR, _I64]
    fn.restype = ctypes.c_int
    return dll


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, H, D] against paged K/V [NB, BS, KVH, D]; float32, contiguous, on the CPU.

    `new_kv` = (k [N, KVH, D], v [N, KVH, D], slots [N]): rows written into the caches
    first, in the same call (write_kv fused)."""
    dll = load()
    assert dll is not None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    b, h, d = q.shape
    out = torch.empty_like(q)
    if new_kv is None:
        k_ptr = v_ptr = slot_ptr = num_new = 0
    else:
        k_new, v_new, slots = (t.contiguous() for t in new_kv)
        k_ptr, v_ptr, slot_ptr, num_new = k_new.data_ptr(), v_new.data_ptr(), slots.data_ptr(), slots.shape[0]
    status = dll.paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        b, h, k_cache.shape[2], d, k_cache.shape[1], tables.shape[1], scale, window or 0,
        torch.get_num_threads(), k_ptr, v_ptr, slot_ptr, num_new,
    )
    if status != 0:
        raise MemoryError("paged_decode: no memory for the kernel's task list")
    return out


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    # The kernel keeps a GQA group's queries on its stack: at most 16 heads x 256 dims.
    group = q.shape[1] // k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and group <= 16 and group * q.shape[2] <= 16 * 256
            and load() is not None)
