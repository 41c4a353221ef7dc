"""Python API over the fused elementwise kernels (csrc/fused_ops.cu): residual add + RMSNorm,
rotary embedding of q and k in the fused QKV projection with the KV-cache write, SiLU-and-mul.

Like kernels.ops: CUDA tensors run through CuPy on torch's current stream, CPU tensors under
the emulator unless a backend is given. Rows are 2-D [tokens, features] with the features
contiguous and the row stride free. The 16-byte instances run where the feature count, the
row strides and every base address allow 16-byte accesses; the others take one element at a
time.
"""

from __future__ import annotations

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.arg_checks import (
    SLOT_DTYPES,
    cache_scales,
    check_cache,
    dtype_name,
    is_fp8_cache,
)
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.launch_plan import block_threads

NORM_MAX_THREADS = 1024  # one CTA per row; fused_add_rms_norm's launch bound
ELEMWISE_THREADS = 256


def _check_rows(name: str, t: torch.Tensor, features: int | None = None) -> None:
    if t.dim() != 2 or (features is not None and t.shape[1] != features):
        want = "[tokens, features]" if features is None else f"[tokens, {features}]"
        raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: features must be contiguous, strides {t.stride()}")


def _vec_for(dtype: str, features: int, tensors: list[torch.Tensor]) -> int:
    """16-byte accesses when every row of every tensor starts 16-byte aligned."""
    vec = instances.fused_vec(dtype)
    ok = features % vec == 0 and all(
        t.data_ptr() % 16 == 0 and (t.dim() == 1 or t.stride(0) % vec == 0) for t in tensors
    )
    return vec if ok else 1


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    backend: KernelBackend | None = None,
) -> torch.Tensor:
    """weight * rmsnorm(x + residual), with residual <- x + residual in place; without a
    residual weight * rmsnorm(x). Rounds as torch does in x's dtype: the sum and the normalized
    row are rounded before the next product. Returns `out` ([tokens, hidden], new if None)."""
    _check_rows("x", x)
    rows, hidden = x.shape
    dtype = dtype_name(x)
    if residual is not None:
        _check_rows("residual", residual, hidden)
        if residual.shape[0] != rows:
            raise ValueError(f"residual has {residual.shape[0]} rows, x {rows}")
    if weight.dim() != 1 or weight.shape[0] != hidden or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    _check_rows("out", out, hidden)
    tensors = [x, weight, out] + ([residual] if residual is not None else [])
    if any(t.dtype != x.dtype for t in tensors):
        raise TypeError("x, residual, weight and out must share one dtype")
    if rows == 0:
        return out
    be = backend if backend is not None else default_backend(x.device)
    vec = _vec_for(dtype, hidden, tensors)
    kern = be.kernel(instances.fused_module(dtype), instances.add_rms_norm_name(dtype, vec))
    res = residual if residual is not None else x  # not read without a residual
    with be.launch_context(x.device):
        kern(
            (rows,),
            (block_threads(hidden // vec, NORM_MAX_THREADS),),
            (
                be.ptr(x),
                be.ptr(res),
                be.ptr(weight),
                be.ptr(out),
                np.int32(hidden),
                np.int32(residual is not None),
                np.int64(x.stride(0)),
                np.int64(res.stride(0)),
                np.int64(out.stride(0)),
                np.float32(eps),
            ),
        )
    return out


def silu_and_mul(
    gate_up: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: KernelBackend | None = None,
) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of 2 x inter features; returns [tokens, inter]."""
    _check_rows("gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up needs an even number of features, got {width}")
    inter = width // 2
    dtype = dtype_name(gate_up)
    if out is None:
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    _check_rows("out", out, inter)
    if out.dtype != gate_up.dtype or out.shape[0] != rows:
        raise ValueError("out must be [tokens, inter] of gate_up's dtype")
    if rows == 0 or inter == 0:
        return out
    be = backend if backend is not None else default_backend(gate_up.device)
    # The up half starts inter elements into the row: it must be aligned too.
    vec = _vec_for(dtype, inter, [gate_up, out])
    kern = be.kernel(instances.fused_module(dtype), instances.silu_and_mul_name(dtype, vec))
    threads = block_threads(inter // vec, ELEMWISE_THREADS)
    with be.launch_context(gate_up.device):
        kern(
            (rows, -(-(inter // vec) // threads)),
            (threads,),
            (
                be.ptr(gate_up),
                be.ptr(out),
                np.int32(inter),
                np.int64(gate_up.stride(0)),
                np.int64(out.stride(0)),
            ),
        )
    return out


def rotary_qkv_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: KernelBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Neox rotary embedding (rotate halves) of the q and k heads of a fused QKV projection
    [tokens, (num_heads + 2 num_kv_heads) head_dim], in place, and the rotated k and v written
    to their cache slots (reshape_and_cache's contract: negative slot = not stored). cos / sin:
    token t's rotary_dim / 2 values ([tokens, rotary_dim / 2] or [tokens, 1, rotary_dim / 2]);
    rotary_dim, their width times two, may be less than head_dim (partial rotary: the first
    rotary_dim dims of each head rotate, the others pass through).
    Returns q [tokens, num_heads, head_dim], k and v [tokens, num_kv_heads, head_dim]: views
    of qkv, as the attention kernels take them. An fp8 cache (float16 / bfloat16 qkv) stores
    fp8(k / k_scale) and fp8(v / v_scale) as reshape_and_cache does."""
    _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    _check_rows("qkv", qkv, (num_heads + 2 * num_kv_heads) * head_dim)
    dtype = dtype_name(qkv)
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head size, got {head_dim}")
    tokens = qkv.shape[0]
    cos2 = cos.reshape(cos.shape[0], -1) if cos.dim() else cos
    sin2 = sin.reshape(sin.shape[0], -1) if sin.dim() else sin
    rot_half = cos2.shape[1] if cos2.dim() == 2 else 0
    for name, t in (("cos", cos2), ("sin", sin2)):
        if (t.dim() != 2 or t.shape[0] < tokens or not 0 < t.shape[1] <= head_dim // 2
                or t.shape[1] != rot_half or t.stride(1) != 1):
            raise ValueError(f"{name} must hold one count (up to {head_dim // 2}) of contiguous values per "
                             f"token, got {tuple(t.shape)}")
    if cos2.stride(0) != sin2.stride(0):
        raise ValueError("cos and sin must share one row stride")
    kv_fp8 = is_fp8_cache(k_cache)
    if any(t.dtype != qkv.dtype for t in (cos2, sin2)) or (k_cache.dtype != qkv.dtype and not kv_fp8):
        raise TypeError("qkv, cos, sin and the caches must share one dtype (or the caches are fp8)")
    if kv_fp8 and dtype not in instances.TENSOR_CORE_DTYPES:
        raise TypeError(f"an fp8 cache takes float16 / bfloat16 qkv, got {qkv.dtype}")
    scales = cache_scales(k_cache, k_scale, v_scale)
    if slot_mapping.dtype not in SLOT_DTYPES or slot_mapping.dim() != 1 or slot_mapping.shape[0] < tokens:
        raise ValueError("slot_mapping must be a 1-D int32 or int64 tensor with a slot per token")
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    if tokens == 0:
        return q, k, v
    be = backend if backend is not None else default_backend(qkv.device)
    spec = instances.rotary_fp8_module(dtype) if kv_fp8 else instances.fused_module(dtype)
    kern = be.kernel(spec, instances.rotary_name(dtype, SLOT_DTYPES[slot_mapping.dtype], kv_fp8))
    with be.launch_context(qkv.device):
        kern(
            (tokens,),
            (block_threads((num_heads + num_kv_heads) * head_dim // 2, ELEMWISE_THREADS),),
            (
                be.ptr(qkv),
                be.ptr(cos2),
                be.ptr(sin2),
                be.ptr(k_cache),
                be.ptr(v_cache),
                be.ptr(slot_mapping.contiguous()),
                np.int64(qkv.stride(0)),
                np.int64(cos2.stride(0)),
                np.int32(num_heads),
                np.int32(num_kv_heads),
                np.int32(head_dim),
                np.int32(rot_half),
                *scales,
            ),
        )
    return q, k, v
