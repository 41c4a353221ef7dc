"""Torch reference implementations of the kernels' contracts (see kernels.ops for layouts).

Written for clarity, not speed: gather each sequence's K/V through its block table and run
plain causal softmax attention. Attention returns a new tensor in `dtype` (float64 by
default, so tests compare against an exact-as-possible oracle); the cache ops work in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    rows_k = k_cache.view(-1, *k_cache.shape[2:])
    rows_v = v_cache.view(-1, *v_cache.shape[2:])
    rows_k[slots[keep]] = key[keep].to(k_cache.dtype)
    rows_v[slots[keep]] = value[keep].to(v_cache.dtype)


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
