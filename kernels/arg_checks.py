"""What the launch wrappers check before they launch: the torch dtypes that have kernel
instances, the row and KV-cache layouts the kernels index, int32 metadata, and the sliding
window and soft-cap arguments. A wrong shape here is a clear error; past here it is a wrong
address inside a kernel."""

from __future__ import annotations

import numpy as np
import torch

from noria.kernels.instances import AttentionConfig

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SLOT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
# The fp8 KV cache's dtype (worker/kv_fp8.py): e4m3 bytes, read as fp8 * the layer's scale.
FP8 = torch.float8_e4m3fn


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def cache_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[np.float32, np.float32]:
    """The kernels' (k_scale, v_scale) arguments: the layer's for an fp8 cache, 1 for another
    (whose values are stored as they are)."""
    if not is_fp8_cache(cache):
        return np.float32(1.0), np.float32(1.0)
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not 0.0 < float(value) < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return np.float32(k_scale), np.float32(v_scale)


def attention_config(query: torch.Tensor, k_cache: torch.Tensor, head_dim: int, block_size: int) -> AttentionConfig:
    """The instance configuration of an attention launch: the query's dtype, over a cache of
    that dtype or an fp8 one."""
    if not is_fp8_cache(k_cache) and k_cache.dtype != query.dtype:
        raise TypeError(f"query ({query.dtype}) and KV cache ({k_cache.dtype}) dtypes differ; the cache is "
                        "the query's dtype or fp8")
    return AttentionConfig(dtype_name(query), head_dim, block_size, kv_fp8=is_fp8_cache(k_cache))


def dtype_name(t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {t.dtype}; one of {list(DTYPE_NAMES)}") from None


def check_rows(name: str, t: torch.Tensor, heads: int, head_dim: int) -> None:
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != head_dim:
        raise ValueError(f"{name} must be [tokens, {heads}, {head_dim}], got {tuple(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != head_dim:
        raise ValueError(f"{name}: heads and head_dim must be contiguous, strides {t.stride()}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] "
            f"of one dtype, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return block_size, num_kv_heads, head_dim


def check_int32(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype != torch.int32 or t.dim() != ndim:
        raise ValueError(f"{name} must be an int32 tensor with {ndim} dims")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def check_window(window: int | None, soft_cap: float | None) -> tuple[np.int32, np.float32]:
    """The kernels' (window, soft_cap) arguments; 0 turns either off."""
    if window is not None and (not isinstance(window, int | np.integer) or window < 1):
        raise ValueError(f"window must be a positive number of tokens or None, got {window!r}")
    if soft_cap is not None and not (0.0 < float(soft_cap) < float("inf")):
        raise ValueError(f"soft_cap must be a positive finite number or None, got {soft_cap!r}")
    if window is not None and window >= 1 << 30:
        window = None  # a window no context reaches
    return np.int32(window or 0), np.float32(soft_cap or 0.0)


def check_attention_args(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor,
) -> tuple[int, int, int]:
    """The shape checks decode and prefill share (out has one row per query row); returns
    (block_size, num_kv_heads, head_dim)."""
    block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    num_rows, num_heads = query.shape[0], query.shape[1]
    check_rows("query", query, num_heads, head_dim)
    if out.shape != (num_rows, num_heads, head_dim) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_rows}, {num_heads}, {head_dim}] tensor")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads}")
    check_int32("block_tables", block_tables, 2)
    check_int32("seq_lens", seq_lens, 1)
    return block_size, num_kv_heads, head_dim
