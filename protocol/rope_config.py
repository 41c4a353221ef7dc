"""A checkpoint's rotary embedding as config.json gives it (worker/models/rope.py turns it into numbers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """`factor` is resolved here: yarn and longrope without one take
    max_position_embeddings / original_max_position_embeddings, as transformers does."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Rotary on the first int(head_dim * partial_rotary_factor) dims of each head (Phi-3); the rest pass through.
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None  # yarn / longrope: cos and sin scale; None = derived from factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    max_position_embeddings: int = 2048
    # The engine's context length (--max-model-len): longrope takes its long factors when
    # it exceeds original_max_position_embeddings (fixed at start-up, as vLLM does).
    max_model_len: int | None = None


def rope_kind(params: Mapping[str, Any]) -> str:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return "longrope" if kind == "su" else kind  # Phi-3's first checkpoints named longrope so


def rope_params(cfg: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope dict of config.json (of one layer type, where transformers >= 5 nests them by
    type), with older configs' rope_theta / rope_scaling folded in."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and layer_type in params:
        return dict(params[layer_type])
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):
        params = {**scaling, **params}
    return params


def read_rope(cfg: Mapping[str, Any], params: Mapping[str, Any], max_model_len: int | None = None) -> RopeSpec:
    """`params`: rope_params(cfg, ...); ValueError names what noria does not implement."""
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope_kind(params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    # Phi-3 keeps its pretraining length beside the rope dict, and transformers prefers it there.
    outer = cfg.get("original_max_position_embeddings")
    original = int(outer if outer and rope_type in ("llama3", "yarn", "longrope")
                   else params.get("original_max_position_embeddings") or max_pos)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is outside (0, 1]")
    factor = params.get("factor")
    if factor is None:
        if rope_type in ("linear", "dynamic"):
            raise ValueError(f"rope type {rope_type!r} needs a scaling factor in rope_scaling")
        factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0
    if rope_type == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise ValueError("rope type 'longrope' needs short_factor and long_factor in rope_scaling")

    def optional(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        attention_factor=optional("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        max_position_embeddings=max_pos,
        max_model_len=max_model_len,
    )


def context_length(cfg: Mapping[str, Any], local_rope: bool) -> int:
    """The longest context the model serves (`max_model_len`'s default and bound), vLLM's rule:
    max_position_embeddings scaled by the factor of linear and dynamic scaling, and for yarn
    original_max_position_embeddings times the factor; llama3 and longrope configs already
    name the extended length, and a model with a rope per layer type (Gemma 3) serves
    max_position_embeddings."""
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind not in ("linear", "dynamic", "yarn") or not factor or local_rope:
        return max_pos
    base = int(rope.get("original_max_position_embeddings") or max_pos) if kind == "yarn" else max_pos
    return int(base * float(factor))
