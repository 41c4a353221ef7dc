"""The attention interface the worker's layers and every attention backend share, typed.

It lives in kernels/ because both sides import it: worker/ (the torch backend, the layers)
and kernels/ (the CUDA kernels' backend), which must not import worker/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout; shared by every layer.

    `*_host` lists mirror device tensors so per-sequence loops never sync the device.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, slot = block * block_size + offset
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int64, context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with the null block
    block_size: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    query_start_host: list[int]
    backend_data: Any = field(default=None, repr=False)  # filled by AttentionBackend.prepare


@dataclass(frozen=True)
class LayerAttention:
    """Static facts about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    # Gemma 2's attention logit soft-capping: every score s becomes cap * tanh(s / cap)
    # before the softmax (None: scores as they are).
    logits_soft_cap: float | None = None
    # An fp8 KV cache's scales (worker/kv_fp8.py): a cached K value reads as fp8 * k_scale, V as
    # fp8 * v_scale; other cache dtypes ignore them.
    k_scale: float = 1.0
    v_scale: float = 1.0


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step data (gather indices, masks) once for all layers."""

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
        """q: [T, H, D]; k, v: [T, KVH, D] (new tokens). Writes k, v into the cache
        at `meta.slot_mapping` and returns the attention output [T, H, D]."""
        ...
