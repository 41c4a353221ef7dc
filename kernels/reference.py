"""Torch reference implementations of the kernels' contracts (see kernels.ops for layouts).

Written for clarity, not speed: gather each sequence's K/V through its block table and run
plain causal softmax attention. Attention returns a new tensor in `dtype` (float64 by
default, so tests compare against an exact-as-possible oracle); the cache ops work in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 KV cache stores for x: fp8(x / scale), divided in float32, saturated to
    +-448 (NaN stays NaN), rounded to nearest even (worker/kv_fp8.py's quantize)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_dequantize(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache's bytes read as, in float64: the exact e4m3 value times the scale."""
    return cache.double() * scale


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """An fp8 cache stores fp8_quantize(key, k_scale) and fp8_quantize(value, v_scale); other
    caches store the values as they are."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    rows_k = k_cache.view(-1, *k_cache.shape[2:])
    rows_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8:
        key, value = fp8_quantize(key, k_scale), fp8_quantize(value, v_scale)
        rows_k, rows_v = rows_k.view(torch.uint8), rows_v.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    rows_k[slots[keep]] = key[keep].to(rows_k.dtype)
    rows_v[slots[keep]] = value[keep].to(rows_v.dtype)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` tokens of one sequence as [length, num_kv_heads, head_dim]."""
    block_size = k_cache.shape[1]
    blocks = table_row[: -(-length // block_size)].long()
    k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:length]
    v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:length]
    return k, v


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [n, H, D] at positions q_pos [n] over k/v [ctx, KVH, D]; key j is visible to a query
    at position p when j <= p, and with a sliding window also j > p - window. With soft_cap
    every score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) before the softmax.
    Query head h uses KV head h // (H // KVH). Rows that see no key are zero."""
    n, num_heads, head_dim = q.shape
    if k.shape[0] == 0:
        return torch.zeros(n, num_heads, head_dim, dtype=q.dtype)
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,jhd->hnj", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    keys = torch.arange(k.shape[0]).view(1, 1, -1)
    visible = keys <= q_pos.view(1, -1, 1)
    if window is not None:
        visible &= keys > q_pos.view(1, -1, 1) - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.einsum("hnj,jhd->nhd", probs, v)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        k, v = gather_kv(k_cache, v_cache, block_tables[s], length)
        q_pos = torch.tensor([length - 1])
        out[s] = attend(query[s : s + 1].to(dtype), k.to(dtype), v.to(dtype), q_pos, scale, window, soft_cap)[0]
    return out


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=dtype)
    for s in range(seq_lens.shape[0]):
        begin, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if end == begin:
            continue
        length = int(seq_lens[s])
        k, v = gather_kv(k_cache, v_cache, block_tables[s], length)
        q_pos = torch.arange(length - (end - begin), length)
        out[begin:end] = attend(
            query[begin:end].to(dtype), k.to(dtype), v.to(dtype), q_pos, scale, window, soft_cap
        )
    return out


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for s_cache, d_cache in zip(src_caches, dst_caches, strict=True):
        d_cache[dst.to(d_cache.device)] = s_cache[src.to(s_cache.device)].to(d_cache.device)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(s) in float64, s) with s = x + residual rounded to x's dtype (the
    residual stream is stored in that dtype), or s = x without a residual."""
    s = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    sd = s.double()
    normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed, s


def rotary_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by halves in float64; cos / sin [tokens, head_dim / 2]."""
    x = x.double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def gemm_w4a16(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias in float64, W[n][k] = (q[n][k] - zero[n][k // group]) * scale[n][k // group]
    from QuantLinear's unpacked tensors (q int8 [N, K], scale / zero [N, K // group])."""
    n, k = q.shape
    w = q.double().view(n, -1, group)
    if zero is not None:
        w = w - zero.double()[..., None]
    w = (w * scale.double()[..., None]).view(n, k)
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()
