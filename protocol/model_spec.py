"""The one description of a checkpoint's model, read once from its config.json, torch-free.

Every process reads it: the frontend's checkpoint pre-check and context length, the
scheduler's vocabulary and context, the tensor-parallel check, the worker's modules, weight
loading and native CPU stack, `noria doctor`, the roofline and the benchmarks. The family's
`Recipe` (protocol/families/) is resolved here against config.json, so the worker never
reads a config key: it builds everything from the fields below. Keys config.json leaves out
take the family's `defaults` (transformers' config-class defaults); tests compare the result
with transformers' own reading of the same files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noria.protocol.families import SUPPORTED_ARCHITECTURES, find_family
from noria.protocol.quant_config import QuantSpec, read_quant
from noria.protocol.recipe import Family
from noria.protocol.rope_config import (
    SUPPORTED_ROPE_TYPES,
    RopeSpec,
    context_length,
    read_rope,
    rope_params,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelSpec", "RopeSpec", "model_spec", "read_config",
           "read_spec"]

# The gated MLP's activations the layers implement, by their config.json names.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeSpec
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    dtype: str | None  # the checkpoint's torch dtype name ("bfloat16"), None if config.json names none
    # The longest context the model serves: max_position_embeddings, scaled by linear, dynamic
    # or yarn rope scaling (`--max-model-len`'s default and bound; vLLM's rule).
    context_length: int = field(default=0, kw_only=True)
    # The layer recipe, resolved (protocol/recipe.py). Keyword-only with Llama's values as
    # defaults, so that a spec written in a test names only what differs.
    norm: str = field(default="rms", kw_only=True)  # "rms" or "rms_one_plus"
    sandwich_norms: bool = field(default=False, kw_only=True)
    activation: str = field(default="silu", kw_only=True)  # "silu", "gelu_tanh" or "gelu"
    embed_scale: bool = field(default=False, kw_only=True)
    attn_scale: float = field(default=0.0, kw_only=True)  # 0: head_dim ** -0.5
    attn_softcap: float | None = field(default=None, kw_only=True)
    final_softcap: float | None = field(default=None, kw_only=True)
    local_rope: RopeSpec | None = field(default=None, kw_only=True)  # the sliding layers' own, or None
    fused_checkpoint: bool = field(default=False, kw_only=True)
    # Mixture of experts; num_experts 0 is a dense model.
    num_experts: int = field(default=0, kw_only=True)
    num_experts_per_tok: int = field(default=0, kw_only=True)
    moe_intermediate_size: int = field(default=0, kw_only=True)  # each expert's; intermediate_size is the dense MLP's
    shared_expert_intermediate_size: int = field(default=0, kw_only=True)  # 0: none
    norm_topk_prob: bool = field(default=False, kw_only=True)
    router_weights_in_model_dtype: bool = field(default=True, kw_only=True)
    sparse_layers: tuple[bool, ...] = field(default=(), kw_only=True)  # per layer: a MoE block (else dense MLP)
    expert_parts: tuple[str, str, str] = field(default=("gate_proj", "up_proj", "down_proj"), kw_only=True)
    # quantization_config, read (protocol/quant_config.py); None: float weights.
    quantization: QuantSpec | None = field(default=None, kw_only=True)
    # Multi-token-prediction layers stored beside the decoder (MiMo's `num_nextn_predict_layers`):
    # the target's own drafter for `{"method": "mtp"}` speculation, unused otherwise.
    mtp_layers: int = field(default=0, kw_only=True)

    @property
    def scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.attn_scale or self.head_dim**-0.5

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder as a dict; FileNotFoundError / ValueError say why not."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the config of {str(folder)!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return cfg


def read_spec(folder: str | Path, max_model_len: int | None = None) -> ModelSpec:
    """The spec of a checkpoint folder. `max_model_len`: the engine's context length where one
    is set (longrope picks its factors by it)."""
    return model_spec(read_config(folder), max_model_len)


def model_spec(config: Mapping[str, Any] | Any, max_model_len: int | None = None) -> ModelSpec:
    """The spec of a config.json dict (or a transformers config, through its to_dict()); ValueError
    names what noria does not implement."""
    raw = dict(config) if isinstance(config, Mapping) else config.to_dict()
    family = find_family(raw)
    if family is None:
        archs = raw.get("architectures") or raw.get("model_type", "?")
        raise ValueError(f"unsupported model architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for alias, key in family.aliases.items():
        if raw.get(key) is None and raw.get(alias) is not None:
            raw[key] = raw[alias]
    cfg = {**family.defaults, **raw}
    r = family.recipe

    def flag(entry: bool | str) -> bool:
        return bool(cfg.get(entry, False)) if isinstance(entry, str) else entry

    act_name = cfg.get(r.activation_key) or cfg.get("hidden_act") or "silu"
    activation = _ACTIVATIONS.get(act_name)
    if activation is None:
        raise ValueError(f"unsupported activation {act_name!r} for {family.architecture}; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{family.architecture} with use_bidirectional_attention (an embedding model) "
                         "is not supported")
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    windows = _sliding_windows(cfg, family, num_layers)
    local = r.local_rope and any(w is not None for w in windows)
    rope = read_rope(cfg, rope_params(cfg, "full_attention" if r.local_rope else None), max_model_len)
    quantization = read_quant(cfg)
    moe = _moe_fields(cfg, family, num_layers)
    if quantization is not None and moe.get("num_experts"):
        from noria.protocol.quant_moe import check_quantized_moe

        check_quantized_moe(quantization, family.architecture)
    spec = ModelSpec(
        architecture=family.architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        # A sequence-classification checkpoint has a `score` head instead of an lm_head
        # (worker/score_head.py reads it): like a tied model, it ships none to load.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or _classifier(raw),
        qkv_bias=flag(r.qkv_bias),
        o_bias=flag(r.o_bias),
        mlp_bias=flag(r.mlp_bias),
        qk_norm=r.qk_norm,
        rope=rope,
        sliding_windows=windows,
        dtype=_dtype(cfg),
        context_length=context_length(cfg, r.local_rope),
        norm=r.norm,
        sandwich_norms=r.sandwich_norms,
        activation=activation,
        embed_scale=r.embed_scale,
        attn_scale=float(cfg[r.attn_scale_key]) ** -0.5 if r.attn_scale_key else 0.0,
        attn_softcap=_positive(cfg.get(r.attn_softcap_key)) if r.attn_softcap_key else None,
        final_softcap=_positive(cfg.get(r.final_softcap_key)) if r.final_softcap_key else None,
        local_rope=read_rope(cfg, rope_params(cfg, "sliding_attention"), max_model_len) if local else None,
        fused_checkpoint=r.fused_checkpoint,
        quantization=quantization,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        **moe,
    )
    if quantization is not None and spec.num_experts:
        from noria.protocol.quant_moe import check_experts

        check_experts(spec)
    return spec


def _classifier(raw: Mapping[str, Any]) -> bool:
    return any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in raw.get("architectures") or ())


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _dtype(cfg: Mapping[str, Any]) -> str | None:
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else None


def _sliding_windows(cfg: Mapping[str, Any], family: Family, num_layers: int) -> tuple[int | None, ...]:
    """Which layers slide, as transformers' modelling code reads the config."""
    window, rule = cfg.get("sliding_window"), family.recipe.windows
    layer_types = cfg.get("layer_types")
    if rule == "none" or not window:
        return (None,) * num_layers
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if rule == "pattern":  # every pattern-th layer is global, the others slide
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or family.recipe.window_pattern)
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    if rule == "every" or (rule == "switched" and cfg.get("use_sliding_window")):
        return (window,) * num_layers
    if not cfg.get("use_sliding_window"):
        return (None,) * num_layers
    bound = int(cfg.get("max_window_layers", num_layers))
    if rule == "odd_below_max_window_layers":
        return tuple(window if (i + 1) % 2 and i < bound else None for i in range(num_layers))
    return tuple(window if i >= bound else None for i in range(num_layers))


def _moe_fields(cfg: Mapping[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts facts of a sparse family (none for a dense one), read as
    transformers' modelling code reads them."""
    moe = family.recipe.moe
    if moe is None:
        return {}
    num_experts = int(cfg.get(moe.experts_key) or 0)
    if moe.every_layer:
        sparse = (True,) * num_layers
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    top_k = int(cfg["num_experts_per_tok"])
    if any(sparse) and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not between 1 and the {num_experts} experts of "
                         f"{family.architecture}")
    norm = moe.norm_topk_prob
    return {"num_experts": num_experts if any(sparse) else 0, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg[moe.expert_size_key]),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
            if moe.shared_expert else 0,
            "norm_topk_prob": bool(cfg.get(norm, False)) if isinstance(norm, str) else norm,
            "router_weights_in_model_dtype": moe.weights_in_model_dtype, "sparse_layers": sparse,
            "expert_parts": moe.parts}
