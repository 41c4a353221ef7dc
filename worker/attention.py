"""Paged attention over a ragged batch: metadata, the backend interface, the torch backend.

The torch backend runs on CPU and GPU and is the reference for kernel backends.
KV cache per layer: K and V tensors of shape [num_blocks, block_size, num_kv_heads,
head_dim]. The tensors hold one block more than the scheduler knows of: that last
"null block" pads block tables; a batched gather zeroes what it reads past each
sequence's length (`_decode`), so nothing a block held before reaches an output.
The cache may be narrower than the queries (a bfloat16 cache under float32 activations,
the CPU's --dtype bfloat16): rows are rounded as they are written and widened as they
are read, and the attention itself runs in the queries' dtype. An fp8 cache (--kv-cache-dtype
fp8) also scales: rows are stored as fp8(k / k_scale) and read as fp8 * k_scale with the
layer's scales (LayerAttention.k_scale / v_scale, worker/kv_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from noria.kernels.attention_api import AttentionBackend, AttentionMetadata, LayerAttention
from noria.worker import cpu_kernels
from noria.worker.kv_fp8 import as_bytes, dequantize, is_fp8, quantize

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerAttention", "TorchAttentionBackend", "write_kv"]


@dataclass
class _PrefillSeq:
    row: int
    start: int
    num_query: int
    context: int  # tokens whose KV was already cached before this step
    block_ids: torch.Tensor | None  # blocks covering the sequence; None when context == 0


@dataclass
class _TorchPlan:
    decode_tokens: torch.Tensor | None  # flat token index of each decode row; None = all tokens
    decode_blocks: torch.Tensor | None  # [Bd * max_blocks] block ids to gather
    decode_shape: tuple[int, int]  # (Bd, padded key length)
    decode_seq_lens: torch.Tensor | None  # [Bd]
    decode_tables: torch.Tensor | None  # [Bd, num_blocks]
    prefills: list[_PrefillSeq]
    # Every token as a decode row of its own (see TorchAttentionBackend.ROWS_MAX_LEN), or None.
    token_tables: torch.Tensor | None = None  # [T, num_blocks]: its sequence's block table
    token_lens: torch.Tensor | None = None  # [T]: its position + 1, the keys it sees
    masks: dict[tuple[Any, ...], torch.Tensor | None] = field(default_factory=dict)


class TorchAttentionBackend:
    """Decode rows (one query token) go through one batched gather + one SDPA call;
    every other sequence (prefill chunks, prefix hits) gets its own SDPA call.

    On the CPU with the native kernel, a step whose prefills are all short runs as
    one decode call instead: each prompt token is a row of its own that attends to
    its sequence's keys up to its position, the step's new K/V written first. Per
    layer that is one dispatch for the whole step instead of a write, a mask and
    an SDPA per sequence. A sequence's rows are attended in tiles of rows, each tile of
    keys read once for all of them (worker/csrc/paged_decode_runs.h), as SDPA's tiles reuse
    a K/V load across queries; past ROWS_MAX_LEN keys SDPA catches up (one fresh prompt,
    12 heads of 64 over 4 KV heads, bf16 cache, 2 threads, attention alone: rows 0.53-0.56x
    SDPA's time at 128-512 tokens, 0.76-0.86x at 768-1,024, 0.91-0.99x at 2,048, 1.06x
    at 3,072; before the tiles 0.80x at 512, 1.09x at 1,024, 1.34x at 2,048)."""

    name = "torch"
    ROWS_MAX_LEN = 1024
    # A decode step's prepare() only takes views of the metadata's tensors and its forward()
    # reads lengths from the device, so CUDA graphs may capture it (worker/cuda_graphs.py).
    graph_safe = True

    def __init__(self, native: bool = True) -> None:
        # `native`: decode through worker/cpu_kernels on the CPU when it builds.
        self.native = native

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        decode_rows = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
        prefill_rows = [i for i, n in enumerate(meta.query_lens_host) if n != 1]
        decode_tokens = decode_blocks = decode_seq_lens = tables = None
        decode_shape = (0, 0)
        if decode_rows:
            max_len = max(meta.seq_lens_host[i] for i in decode_rows)
            num_blocks = -(-max_len // bs)
            tables = meta.block_tables[:, :num_blocks]
            decode_seq_lens = meta.seq_lens
            if prefill_rows:
                rows = torch.tensor(decode_rows, device=meta.block_tables.device)
                tables = tables[rows]
                decode_seq_lens = meta.seq_lens[rows]
                decode_tokens = meta.query_start_loc[rows]
            decode_blocks = tables.reshape(-1)
            decode_shape = (len(decode_rows), num_blocks * bs)
        prefills = []
        for i in prefill_rows:
            n, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
            context = seq_len - n
            blocks = meta.block_tables[i, : -(-seq_len // bs)] if context else None
            prefills.append(_PrefillSeq(i, meta.query_start_host[i], n, context, blocks))
        plan = _TorchPlan(decode_tokens, decode_blocks, decode_shape, decode_seq_lens, tables, prefills)
        if prefills and self.native and max(meta.seq_lens_host[p.row] for p in prefills) <= self.ROWS_MAX_LEN:
            seq_index = torch.repeat_interleave(torch.arange(len(meta.query_lens_host), device=meta.positions.device),
                                                torch.tensor(meta.query_lens_host, device=meta.positions.device))
            num_blocks = -(-max(meta.seq_lens_host) // bs)
            plan.token_tables = meta.block_tables[seq_index, :num_blocks].contiguous()
            plan.token_lens = meta.positions + 1
        meta.backend_data = plan

    def paged_rows(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block table, keys seen) per query row when the whole step is one call of the native
        paged kernel per layer (decode rows, or every prompt token as a row), else None."""
        plan: _TorchPlan = meta.backend_data
        if plan.token_tables is not None and plan.token_lens is not None:
            return plan.token_tables, plan.token_lens
        if self.native and plan.decode_tables is not None and plan.decode_seq_lens is not None and not plan.prefills:
            return plan.decode_tables, plan.decode_seq_lens
        return None

    def forward(
        self,
        layer: LayerAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        plan: _TorchPlan = meta.backend_data
        rows = self.paged_rows(meta)
        if rows is not None and cpu_kernels.usable(q, k_cache):
            # One call writes this step's K/V rows and attends: no write_kv dispatch per layer.
            return cpu_kernels.paged_decode(q, k_cache, v_cache, *rows, layer.scale, layer.sliding_window,
                                            new_kv=(k, v, meta.slot_mapping), soft_cap=layer.logits_soft_cap,
                                            kv_scales=(layer.k_scale, layer.v_scale))
        decode_only = plan.decode_blocks is not None and not plan.prefills
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, (layer.k_scale, layer.v_scale))
        if decode_only:
            return self._decode(layer, q, k_cache, v_cache, plan)
        out = torch.empty_like(q)
        if plan.decode_blocks is not None:
            out[plan.decode_tokens] = self._decode(layer, q[plan.decode_tokens], k_cache, v_cache, plan)
        for seq in plan.prefills:
            end = seq.start + seq.num_query
            out[seq.start : end] = self._prefill(layer, q[seq.start : end], k[seq.start : end],
                                                 v[seq.start : end], k_cache, v_cache, seq, plan)
        return out

    def _decode(
        self,
        layer: LayerAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _TorchPlan,
    ) -> torch.Tensor:
        if self.native and cpu_kernels.usable(q, k_cache):
            # In place through the block tables: no gathered copy of the context.
            return cpu_kernels.paged_decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_seq_lens,
                                            layer.scale, layer.sliding_window, soft_cap=layer.logits_soft_cap,
                                            kv_scales=(layer.k_scale, layer.v_scale))
        batch, length = plan.decode_shape
        kvh, d = layer.num_kv_heads, layer.head_dim
        # Gather whole blocks (contiguous memcpy per block) rather than single slots.
        keys = _widen(_gather(k_cache, plan.decode_blocks), q, layer.k_scale).view(batch, length, kvh, d).transpose(1, 2)
        values = _widen(_gather(v_cache, plan.decode_blocks), q, layer.v_scale).view(batch, length, kvh, d).transpose(1, 2)
        # Fold the query heads of a KV group into the query-length axis so K/V
        # are never repeated for GQA: [B, KVH, G, D] against [B, KVH, L, D].
        queries = q.reshape(batch, kvh, layer.num_heads // kvh, d)
        # Past seq_len, a block holds whatever it held: a reused block's stale rows, or
        # anything. Masking the scores does not stop a NaN there (NaN - inf, 0 * NaN),
        # so those keys and values are zeroed in the gathered copy.
        unwritten = plan.masks.get(("unwritten",))
        if unwritten is None:  # once per step, like the masks
            unwritten = self._decode_mask(plan, None, length, q.device).logical_not().transpose(-1, -2)
            plan.masks[("unwritten",)] = unwritten
        keys.masked_fill_(unwritten, 0.0)  # in place: the gathered copies are this call's own
        values.masked_fill_(unwritten, 0.0)
        mask = self._decode_mask(plan, layer.sliding_window, length, q.device)
        if layer.logits_soft_cap is not None:
            out = capped_attention(queries, keys, values, mask, layer.scale, layer.logits_soft_cap)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=layer.scale)
        return out.reshape(batch, layer.num_heads, d)

    @staticmethod
    def _decode_mask(plan: _TorchPlan, window: int | None, length: int, device: torch.device) -> torch.Tensor:
        key = ("decode", window)
        mask = plan.masks.get(key)
        if mask is None:
            assert plan.decode_seq_lens is not None
            pos = torch.arange(length, device=device)
            seq_lens = plan.decode_seq_lens[:, None]
            # Keys past seq_len are the unwritten tail of the last block or padding blocks.
            mask = pos[None, :] < seq_lens
            if window is not None:
                mask &= pos[None, :] > seq_lens - 1 - window
            mask = mask[:, None, None, :]
            plan.masks[key] = mask
        return mask

    def _prefill(
        self,
        layer: LayerAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: _PrefillSeq,
        plan: _TorchPlan,
    ) -> torch.Tensor:
        seq_len = seq.context + seq.num_query
        if seq.block_ids is None:
            # Nothing cached yet: the new tokens are the whole sequence, as the cache holds them
            # (rounded), so that a prompt attends to the keys a later chunk or decode step reads.
            keys = _widen(_narrow(k, k_cache.dtype, layer.k_scale), q, layer.k_scale)
            values = _widen(_narrow(v, v_cache.dtype, layer.v_scale), q, layer.v_scale)
        else:
            kvh, d = layer.num_kv_heads, layer.head_dim
            keys = _widen(_gather(k_cache, seq.block_ids), q, layer.k_scale).view(-1, kvh, d)[:seq_len]
            values = _widen(_gather(v_cache, seq.block_ids), q, layer.v_scale).view(-1, kvh, d)[:seq_len]
        mask = self._prefill_mask(plan, seq, layer.sliding_window, q.device)
        queries, keys, values = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
        if layer.logits_soft_cap is not None:
            if mask is None:  # SDPA's is_causal: query i sees keys 0..i (no context here)
                mask = torch.ones(seq.num_query, seq_len, dtype=torch.bool, device=q.device).tril()
            out = capped_attention(queries, keys, values, mask, layer.scale, layer.logits_soft_cap)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out[0].transpose(0, 1)

    @staticmethod
    def _prefill_mask(
        plan: _TorchPlan, seq: _PrefillSeq, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        if seq.context == 0 and window is None:
            return None  # plain causal: SDPA's is_causal is the fast path
        key = ("prefill", seq.row, window)
        if key not in plan.masks:
            # Query i sits at position context + i and sees keys 0..context + i.
            q_pos = torch.arange(seq.context, seq.context + seq.num_query, device=device)[:, None]
            k_pos = torch.arange(seq.context + seq.num_query, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            plan.masks[key] = mask
        return plan.masks[key]


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     cap: float) -> torch.Tensor:
    """Attention with logit soft-capping, which SDPA cannot do: q [N, H, Lq, D] against
    k, v [N, KVH, Lk, D] (GQA: H a multiple of KVH), `mask` (True = attend) broadcast to
    [N, 1, Lq, Lk]. The op order of transformers' eager attention: scores in the input
    dtype, scaled, capped, then a float32 softmax cast back before the values."""
    n, h, lq, d = q.shape
    kvh = k.shape[1]
    # [N, KVH, G, Lq, D] against [N, KVH, 1, Lk, D]: K/V are shared by a group, not repeated.
    scores = q.reshape(n, kvh, h // kvh, lq, d) @ k.unsqueeze(2).transpose(-1, -2) * scale
    scores = torch.tanh(scores / cap) * cap
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    scores = scores.masked_fill(mask.unsqueeze(2).logical_not(), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (weights @ v.unsqueeze(2)).reshape(n, h, lq, d)


def _widen(cached: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """K/V read from the cache in the queries' dtype: the same tensor where they agree (a
    gathered copy is the caller's own either way); fp8 times its scale."""
    return dequantize(cached, scale, q.dtype) if is_fp8(cached.dtype) else cached.to(q.dtype)


def _narrow(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """New K/V rows as a cache of `dtype` stores them."""
    return quantize(x, scale) if is_fp8(dtype) else x.to(dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks of a cache (fp8 moved as bytes: not every device has fp8 index ops)."""
    return as_bytes(cache).index_select(0, blocks).view(cache.dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scatter new K/V rows [T, KVH, D] into the paged cache (reshape_and_cache), rounded to
    the cache's dtype (nearest even) where it is narrower; an fp8 cache's rows divided by its
    (k_scale, v_scale) first and saturated (kv_fp8.quantize)."""
    kvh, d = k.shape[1], k.shape[2]
    for new, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        as_bytes(cache).view(-1, kvh, d).index_copy_(0, slots, as_bytes(_narrow(new, cache.dtype, scale)))
