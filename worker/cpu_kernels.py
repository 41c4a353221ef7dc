"""The paged decode attention kernel for the torch backend (worker/csrc/paged_decode.c).

Built by worker/native_build.py. If no compiler works or worker/cpu_ops.py puts the
attention family on torch, `load()` returns None and the backend keeps its torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "paged_decode.c"
# Reassociation lets the dot products vectorize and no errno lets expf use the vector
# math library; nothing else of -ffast-math.
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The cache dtypes the kernel reads, by the suffix of its entry points. fp8's entry points take the
# layer's K and V scales after the others' arguments (worker/kv_fp8.py).
CACHE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "fp8"}


@cache
def load() -> ctypes.CDLL | None:
    if disabled("attention"):
        return None
    dll = build(_SRC, _FLAGS)
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the kernel's entry points on a build of paged_decode.c."""
    # Pointers travel as plain ints (data_ptr()): cheaper per call than ctypes.cast.
    args = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
            ctypes.c_float, _I64, ctypes.c_int, _PTR, _PTR, _PTR, _I64]
    for dtype in CACHE_DTYPES.values():
        plain, capped = getattr(dll, f"paged_decode_{dtype}"), getattr(dll, f"paged_decode_capped_{dtype}")
        scales = [ctypes.c_float, ctypes.c_float] if dtype == "fp8" else []
        plain.argtypes, capped.argtypes = [*args, *scales], [*args, ctypes.c_float, *scales]
        plain.restype = capped.restype = ctypes.c_int
    return dll


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, soft_cap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q [B, H, D] against paged K/V [NB, BS, KVH, D], contiguous, on the CPU: q and the output
    float32, the caches float32, bfloat16, float16 or float8_e4m3fn (widened to float32, exactly, as
    they are read; an fp8 value times its scale of `kv_scales`, K's and V's, which fp8 alone reads).

    `new_kv` = (k [N, KVH, D], v [N, KVH, D], slots [N]): float32 rows written into the caches
    first, in the same call (write_kv fused; into a half cache rounded to nearest even, as
    `.to(k_cache.dtype)` rounds: into float16, past 65504 to infinity, subnormals kept; into fp8 as
    kv_fp8.quantize: x / scale, saturated to +-448).
    `soft_cap`: each score s becomes soft_cap * tanh(s / soft_cap) before the softmax
    (LayerAttention.logits_soft_cap)."""
    dll = load()
    assert dll is not None
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    b, h, d = q.shape
    out = torch.empty_like(q)
    if new_kv is None:
        k_ptr = v_ptr = slot_ptr = num_new = 0
    else:
        k_new, v_new, slots = new_kv[0].float().contiguous(), new_kv[1].float().contiguous(), new_kv[2].contiguous()
        k_ptr, v_ptr, slot_ptr, num_new = k_new.data_ptr(), v_new.data_ptr(), slots.data_ptr(), slots.shape[0]
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            b, h, k_cache.shape[2], d, k_cache.shape[1], tables.shape[1], scale, window or 0,
            torch.get_num_threads(), k_ptr, v_ptr, slot_ptr, num_new)
    suffix = CACHE_DTYPES[k_cache.dtype]
    scales = kv_scales if suffix == "fp8" else ()
    if soft_cap is None:
        status = getattr(dll, f"paged_decode_{suffix}")(*args, *scales)
    else:
        if not soft_cap > 0:
            raise ValueError(f"soft_cap must be positive, got {soft_cap}")
        status = getattr(dll, f"paged_decode_capped_{suffix}")(*args, soft_cap, *scales)
    if status != 0:
        raise MemoryError("paged_decode: no memory for the kernel's task list")
    return out


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and fits(q.shape[1], q.shape[2], k_cache)


def fits(num_heads: int, head_dim: int, k_cache: torch.Tensor) -> bool:
    """Whether float32 queries of this shape can attend to `k_cache` (a dtype of CACHE_DTYPES)
    through the kernel."""
    # The kernel keeps a GQA group's queries on its stack: at most 16 heads x 256 dims.
    group = num_heads // k_cache.shape[2]
    return (k_cache.device.type == "cpu" and k_cache.dtype in CACHE_DTYPES and k_cache.is_contiguous()
            and group <= 16 and group * head_dim <= 16 * 256 and load() is not None)
