"""Can a checkpoint be split over N tensor-parallel ranks? Torch-free, so the
frontend can refuse before it starts any process and the worker can check again.

Megatron-style sharding splits attention heads and MLP columns across ranks.
KV heads are split too; when there are fewer KV heads than ranks, each KV head
is replicated on N / num_kv_heads ranks (as vLLM does), which needs
N % num_kv_heads == 0 so that every rank's query heads share one KV head.
The vocabulary is padded per rank and needs no check. A mixture-of-experts model
splits every expert's intermediate dimension (and a shared expert's) as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from noria.protocol.families import FAMILIES
from noria.protocol.model_spec import ModelSpec, read_spec


@dataclass(frozen=True)
class ShardedShapes:
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    # Mixture of experts: (config.json key, size) of each other intermediate dimension split.
    expert_sizes: tuple[tuple[str, int], ...] = ()


def sharded_shapes(spec: ModelSpec) -> ShardedShapes:
    """The sizes of `spec` that tensor parallelism splits."""
    sizes: list[tuple[str, int]] = []
    family = FAMILIES.get(spec.architecture)
    key = family.recipe.moe.expert_size_key if family and family.recipe.moe else "moe_intermediate_size"
    # Named by the config.json key that holds them; where that is intermediate_size (Mixtral),
    # the dense size's check covers the experts.
    if spec.num_experts and key != "intermediate_size":
        sizes.append((key, spec.moe_intermediate_size))
    if spec.num_experts and spec.shared_expert_intermediate_size:
        sizes.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    return ShardedShapes(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, tuple(sizes))


def read_shapes(model_path: str | Path) -> ShardedShapes | None:
    """The shapes tensor parallelism splits, from the checkpoint's spec;
    None when there is no config.json (the worker reports that itself)."""
    if not (Path(model_path) / "config.json").is_file():
        return None
    return sharded_shapes(read_spec(model_path))


def tensor_parallel_error(shapes: ShardedShapes, tp: int) -> str | None:
    """A sentence naming the numbers that cannot be split over `tp` ranks, or None."""
    if tp < 1:
        return f"tensor_parallel_size must be at least 1, got {tp}"
    h, kvh, inter = shapes.num_heads, shapes.num_kv_heads, shapes.intermediate_size
    if h % tp:
        return (f"tensor_parallel_size {tp} does not divide num_attention_heads {h}; "
                f"use a size that divides {h}")
    if kvh >= tp and kvh % tp:
        return (f"tensor_parallel_size {tp} does not divide num_key_value_heads {kvh}")
    if kvh < tp and tp % kvh:
        return (f"tensor_parallel_size {tp} is larger than num_key_value_heads {kvh} and not a "
                f"multiple of it, so KV heads can be neither split nor replicated evenly")
    if inter % tp:
        return f"tensor_parallel_size {tp} does not divide intermediate_size {inter}"
    for key, size in shapes.expert_sizes:
        if size % tp:
            return f"tensor_parallel_size {tp} does not divide {key} {size}"
    return None


def check_tensor_parallel(model_path: str | Path, tp: int) -> None:
    """Raise ValueError if the checkpoint at `model_path` cannot be split over `tp` ranks."""
    if tp == 1:
        return
    shapes = read_shapes(model_path)
    problem = tensor_parallel_error(shapes, tp) if shapes is not None else None
    if problem:
        raise ValueError(f"cannot shard {model_path}: {problem}")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds (and caches): a share, or one replicated head."""
    return max(1, num_kv_heads // tp)
