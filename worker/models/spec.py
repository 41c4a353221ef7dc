"""The architecture facts a model needs, read once from a Hugging Face config.

Keeping them in one frozen dataclass means the model code never pokes at
`PretrainedConfig` attributes, whose names drift between transformers versions
(`rope_theta`/`rope_scaling` became `rope_parameters`, `torch_dtype` became `dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)

_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """A checkpoint's rotary embedding, as config.json gives it (worker/models/rope.py turns it into numbers).

    `factor` is resolved here: yarn and longrope without one take
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


@dataclass(frozen=True)
class GemmaSpec:
    """What Gemma 2 / 3 add to the decoder (worker/models/gemma.py): scaled embeddings, (1 + w)
    RMSNorms around attention and MLP, GeGLU, an attention scale from query_pre_attn_scalar,
    soft-capped logits, and (Gemma 3) a rope base of their own for the sliding layers."""

    query_pre_attn_scalar: float
    attn_logit_softcap: float | None  # cap * tanh(score / cap) before the softmax; None: off
    final_logit_softcap: float | None  # the same on the output logits
    gelu_approximate: str  # F.gelu's `approximate`: "tanh" (gelu_pytorch_tanh) or "none"
    local_rope: RopeSpec | None  # the sliding layers' rotary (Gemma 3); None: `ModelSpec.rope` for all


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
    checkpoint_dtype: torch.dtype | None
    # Mixture of experts (worker/models/moe.py); num_experts 0 is a dense model. Keyword-only
    # with defaults, so that the dense families need not name them.
    num_experts: int = field(default=0, kw_only=True)
    num_experts_per_tok: int = field(default=0, kw_only=True)
    moe_intermediate_size: int = field(default=0, kw_only=True)  # each expert's; intermediate_size is the dense MLP's
    shared_expert_intermediate_size: int = field(default=0, kw_only=True)  # Qwen2-MoE; 0: none
    norm_topk_prob: bool = field(default=False, kw_only=True)  # renormalise the top-k routing weights to sum 1
    # The Qwen families round the routing weights to the model dtype before weighting; Mixtral keeps float32.
    router_weights_in_model_dtype: bool = field(default=True, kw_only=True)
    sparse_layers: tuple[bool, ...] = field(default=(), kw_only=True)  # per layer: a MoE block (else dense MLP)
    gemma: GemmaSpec | None = field(default=None, kw_only=True)  # Gemma 2 / 3; None for the other families


def _rope_spec(cfg: Any, max_model_len: int | None = None) -> RopeSpec:
    # transformers >= 5 folds theta and scaling into `rope_parameters`; older
    # versions keep `rope_theta` and an optional `rope_scaling` dict.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "su":  # Phi-3's first checkpoints named longrope so
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    max_pos = int(getattr(cfg, "max_position_embeddings", None) or 2048)
    # Phi-3 keeps its pretraining length beside the rope dict, and transformers prefers it there.
    outer = getattr(cfg, "original_max_position_embeddings", None)
    original = int(outer if outer and rope_type in ("llama3", "yarn", "longrope")
                   else params.get("original_max_position_embeddings") or max_pos)
    partial = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
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


def _sliding_windows(cfg: Any, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if arch == "LlamaForCausalLM" or window is None:
        return (None,) * num_layers
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in _GEMMA:  # configs without layer_types: every pattern-th layer is global, the others slide
        pattern = int(getattr(cfg, "sliding_window_pattern", None) or (2 if arch == "Gemma2ForCausalLM" else 6))
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        # transformers windows every layer of these
        return (window,) * num_layers
    if getattr(cfg, "use_sliding_window", False):
        first = int(getattr(cfg, "max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _checkpoint_dtype(cfg: Any) -> torch.dtype | None:
    # Touch `torch_dtype` only on old configs: transformers 5 warns on access.
    value = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def model_spec(cfg: Any, max_model_len: int | None = None) -> ModelSpec:
    """Build a ModelSpec from a transformers config, or raise ValueError naming what is unsupported.

    `max_model_len`: the engine's context length where one is set (longrope picks its factors by it)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if not archs:  # configs built in code (not from a checkpoint) may lack `architectures`
        arch = _BY_MODEL_TYPE.get(getattr(cfg, "model_type", ""))
    if arch is None:
        raise ValueError(
            f"unsupported model architecture {archs or getattr(cfg, 'model_type', '?')}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish") and arch not in _GEMMA:  # Gemma's is hidden_activation (_gemma_spec)
        raise ValueError(f"unsupported activation {act!r} for {arch}; only silu is implemented")
    num_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    num_layers = int(cfg.num_hidden_layers)
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    # Bias layout differs per family: Qwen2 always has q/k/v bias but no o_proj
    # bias; Llama and Qwen3 follow `attention_bias` for all four; Mistral has none.
    qkv_bias, o_bias = {
        "LlamaForCausalLM": (attention_bias, attention_bias),
        "MistralForCausalLM": (False, False),
        "Qwen2ForCausalLM": (True, False),
        "Qwen3ForCausalLM": (attention_bias, attention_bias),
        "MixtralForCausalLM": (False, False),
        "Qwen2MoeForCausalLM": (bool(getattr(cfg, "qkv_bias", True)), False),
        "Qwen3MoeForCausalLM": (attention_bias, attention_bias),
        "Phi3ForCausalLM": (False, False),
        "Gemma2ForCausalLM": (attention_bias, attention_bias),
        "Gemma3ForCausalLM": (attention_bias, attention_bias),
    }[arch]
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        # Gemma 3 keeps a rope per layer type; the full-attention layers' is the model's.
        rope=_rope_spec(_layer_type_rope(cfg, "full_attention") if arch == "Gemma3ForCausalLM" else cfg,
                        max_model_len),
        sliding_windows=_sliding_windows(cfg, arch, num_layers),
        checkpoint_dtype=_checkpoint_dtype(cfg),
        **_moe_fields(cfg, arch, num_layers),
        gemma=_gemma_spec(cfg, arch, max_model_len),
    )


_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class _Overlay:
    """`cfg` with some attributes replaced (a per-layer-type rope dict read by _rope_spec)."""

    def __init__(self, cfg: Any, **attrs: Any) -> None:
        self._cfg = cfg
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def _layer_type_rope(cfg: Any, layer_type: str) -> Any:
    """Gemma 3's rope of one layer type as a config _rope_spec reads. transformers 5 nests
    rope_parameters by layer type; older configs give rope_theta / rope_scaling for the full
    layers and rope_local_base_freq for the sliding ones."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:
        return _Overlay(cfg, rope_parameters=params[layer_type], rope_scaling=None)
    if layer_type == "sliding_attention":
        return _Overlay(cfg, rope_parameters={"rope_type": "default",
                                              "rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)},
                        rope_scaling=None)
    return cfg


def _gemma_spec(cfg: Any, arch: str, max_model_len: int | None) -> GemmaSpec | None:
    if arch not in _GEMMA:
        return None
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"
    if act not in _GELU:
        raise ValueError(f"unsupported activation {act!r} for {arch}; supported: {', '.join(_GELU)}")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{arch} with use_bidirectional_attention (an embedding model) is not supported")

    def cap(name: str) -> float | None:
        value = getattr(cfg, name, None)
        return float(value) if value else None

    gemma3 = arch == "Gemma3ForCausalLM"
    return GemmaSpec(
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        # transformers' Gemma 3 reads attn_logit_softcapping into its config but never applies it.
        attn_logit_softcap=None if gemma3 else cap("attn_logit_softcapping"),
        final_logit_softcap=cap("final_logit_softcapping"),
        gelu_approximate=_GELU[act],
        local_rope=_rope_spec(_layer_type_rope(cfg, "sliding_attention"), max_model_len) if gemma3 else None,
    )


def _moe_fields(cfg: Any, arch: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts facts of a sparse family (none for a dense one), read as
    transformers' modelling code reads them."""
    if arch == "MixtralForCausalLM":
        # Every layer is sparse, intermediate_size is each expert's, and the top-k always renormalised.
        num_experts, shared, norm, in_dtype = int(cfg.num_local_experts), 0, True, False
        inter = int(cfg.intermediate_size)
        sparse = (True,) * num_layers
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        num_experts, inter = int(getattr(cfg, "num_experts", 0) or 0), int(cfg.moe_intermediate_size)
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if arch == "Qwen2MoeForCausalLM" else 0
        norm, in_dtype = bool(getattr(cfg, "norm_topk_prob", False)), True
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in getattr(cfg, "mlp_only_layers", None) or ()}
        sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    else:
        return {}
    top_k = int(cfg.num_experts_per_tok)
    if any(sparse) and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not between 1 and the {num_experts} experts of {arch}")
    return {"num_experts": num_experts if any(sparse) else 0, "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared, "norm_topk_prob": norm,
            "router_weights_in_model_dtype": in_dtype, "sparse_layers": sparse}
