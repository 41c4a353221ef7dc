"""Python API over csrc/cache_ops.cu: the KV-cache write of a step's keys and values
(`reshape_and_cache`) and the batched block copy behind swap-out, swap-in and device-to-device
copies (`copy_blocks`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.arg_checks import (
    SLOT_DTYPES,
    cache_scales,
    check_cache,
    check_rows,
    dtype_name,
    is_fp8_cache,
)
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.launch_plan import block_threads


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: KernelBackend | None = None,
) -> None:
    """Write key[t] / value[t] ([tokens, num_kv_heads, head_dim]) into slot slot_mapping[t]. An
    fp8 cache (float8_e4m3fn, 16-bit keys and values) stores fp8(key / k_scale) and
    fp8(value / v_scale), saturated to +-448 and rounded to nearest even (worker/kv_fp8.py's
    quantize); other caches store the values as they are and ignore the scales."""
    _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    check_rows("key", key, num_kv_heads, head_dim)
    check_rows("value", value, num_kv_heads, head_dim)
    kv_fp8 = is_fp8_cache(k_cache)
    if key.dtype != value.dtype or (key.dtype != k_cache.dtype and not kv_fp8):
        raise TypeError("key, value and the caches must share one dtype (or the caches are fp8)")
    scales = cache_scales(k_cache, k_scale, v_scale)
    if slot_mapping.dtype not in SLOT_DTYPES or slot_mapping.dim() != 1:
        raise ValueError("slot_mapping must be a 1-D int32 or int64 tensor")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError("key, value and slot_mapping disagree on the number of tokens")
    if num_tokens == 0:
        return  # a zero-sized grid is a launch error on a GPU
    be = backend if backend is not None else default_backend(k_cache.device)
    dtype = dtype_name(key)
    if kv_fp8 and dtype not in instances.TENSOR_CORE_DTYPES:
        raise TypeError(f"an fp8 cache takes float16 / bfloat16 keys and values, got {key.dtype}")
    spec = instances.reshape_module(dtype, kv_fp8)
    kern = be.kernel(spec, instances.reshape_name(dtype, SLOT_DTYPES[slot_mapping.dtype], kv_fp8))
    row = num_kv_heads * head_dim
    with be.launch_context(k_cache.device):
        kern(
            (num_tokens,),
            (block_threads(row),),
            (
                be.ptr(key),
                be.ptr(value),
                be.ptr(k_cache),
                be.ptr(v_cache),
                be.ptr(slot_mapping.contiguous()),
                np.int32(key.stride(0)),
                np.int32(value.stride(0)),
                np.int32(row),
                *scales,
            ),
        )


def copy_unit(block_bytes: int, addresses: Sequence[int]) -> int:
    """16-byte copies when every block start is 16-byte aligned, else 4-byte ones."""
    for unit in (16, 4):
        if block_bytes % unit == 0 and all(a % unit == 0 for a in addresses):
            return unit
    raise ValueError("cache blocks must be 4-byte aligned")


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    backend: KernelBackend | None = None,
) -> None:
    """dst_caches[c][dst] = src_caches[c][src] for every (src, dst) row of block_mapping
    ([pairs, 2]) and every cache c, in one launch. Swap-out: GPU caches -> pinned CPU caches;
    swap-in: the reverse; a device-to-device copy: the same caches on both sides. No block may be both
    a source and a destination of one call."""
    if len(src_caches) != len(dst_caches) or not src_caches:
        raise ValueError("src_caches and dst_caches must be equally long and non-empty")
    block_bytes = {t[0].numel() * t.element_size() for t in (*src_caches, *dst_caches)}
    if len(block_bytes) != 1:
        raise ValueError("every cache must have the same bytes per block")
    if any(not t.is_contiguous() for t in (*src_caches, *dst_caches)):
        raise ValueError("caches must be contiguous")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError("block_mapping must be [pairs, 2]")
    pairs = block_mapping.shape[0]
    if pairs == 0:
        return
    nbytes = block_bytes.pop()
    unit = copy_unit(nbytes, [t.data_ptr() for t in (*src_caches, *dst_caches)])
    # The launch runs where the GPU caches are (for a swap, one side is pinned CPU memory).
    run_on = next((t for t in (*src_caches, *dst_caches) if t.is_cuda), src_caches[0])
    be = backend if backend is not None else default_backend(run_on.device)
    device = run_on.device
    src_table = be.pointer_table(src_caches, device)
    dst_table = be.pointer_table(dst_caches, device)
    mapping = block_mapping.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    units = nbytes // unit
    kern = be.kernel(instances.copy_module(), instances.copy_name(unit))
    with be.launch_context(device):
        kern(
            (pairs, len(src_caches)),
            (block_threads(units),),
            (be.ptr(src_table), be.ptr(dst_table), be.ptr(mapping), np.int64(units)),
        )
