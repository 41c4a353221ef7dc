"""Tensor parallelism: the process group and the three collectives the model needs.

All communication goes through `torch.distributed` (gloo on the CPU, NCCL on
CUDA). With one rank there is no process group and every collective is a no-op,
so the single-rank path runs exactly the code it would run without tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from noria.protocol.model_shapes import ShardedShapes, kv_heads_per_rank, tensor_parallel_error


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks in place (row-parallel linears end with this)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape on all ranks) on rank 0, in rank order; None elsewhere."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.first else None
        dist.gather(x.contiguous(), parts, dst=0)
        return parts

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x


@dataclass(frozen=True)
class RankShapes:
    """The slice of the model one rank holds: heads and MLP columns are split
    (Megatron column/row parallel), the vocabulary of the lm_head too (padded to
    `vocab_shard` rows per rank so that every rank's logits have one shape)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_start: int  # first query head of this rank
    kv_head_start: int  # first KV head (replicated heads: the one its query heads use)
    inter_start: int
    vocab_start: int
    vocab_end: int
    vocab_shard: int


def rank_shapes(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                tp: TensorParallel) -> RankShapes:
    """Raises ValueError (the same sentence `noria serve` gives) when the shapes cannot be split."""
    n, r = tp.size, tp.rank
    problem = tensor_parallel_error(ShardedShapes(num_heads, num_kv_heads, intermediate_size), n)
    if problem:
        raise ValueError(problem)
    heads, inter = num_heads // n, intermediate_size // n
    vocab_shard = -(-vocab_size // n)
    vocab_start = min(r * vocab_shard, vocab_size)
    return RankShapes(
        num_heads=heads,
        num_kv_heads=kv_heads_per_rank(num_kv_heads, n),
        intermediate_size=inter,
        head_start=r * heads,
        # Split: r * (kvh / n). Replicated (kvh < n, n % kvh == 0): the KV head of
        # query head r * heads, i.e. r // (n / kvh); one formula covers both.
        kv_head_start=r * num_kv_heads // n,
        inter_start=r * inter,
        vocab_start=vocab_start,
        vocab_end=min(vocab_start + vocab_shard, vocab_size),
        vocab_shard=vocab_shard,
    )


def init_tensor_parallel(rank: int, size: int, init_method: str | None, device: torch.device,
                         timeout_s: float) -> TensorParallel:
    """Join the process group of `size` ranks at `init_method` (e.g. tcp://127.0.0.1:PORT).

    `timeout_s` bounds the rendezvous and every later collective, so a rank that
    never arrives (or dies) turns into an error instead of a hang.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside [0, {size})")
    if size == 1:
        return TensorParallel()
    if init_method is None:
        raise ValueError(f"tensor_parallel_size {size} needs a rendezvous address (dist_init_method)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return TensorParallel(rank, size)


def destroy_tensor_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
