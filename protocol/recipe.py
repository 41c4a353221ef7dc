"""A model family as data: how its config.json is read and how its decoder layer is built.

One `Family` per file in protocol/families/ (found there by name, nothing else to register).
Its `Recipe` says what the layer is made of: the worker builds its torch modules, its weight
loading and its native CPU stack from the recipe (via the `ModelSpec` the recipe resolves for
one checkpoint), so a family that differs from Llama in two entries is a file with two entries.
An entry given as a string names the config.json key that holds it (the family's `defaults`
say what transformers assumes when the file leaves it out).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Norm = Literal["rms", "rms_one_plus"]
Windows = Literal["none", "every", "switched", "pattern", "max_window_layers", "odd_below_max_window_layers"]


@dataclass(frozen=True)
class MoeRecipe:
    """A sparse (mixture-of-experts) MLP: router, top-k experts, an optional shared expert."""

    experts_key: str = "num_experts"
    # config.json key of each expert's intermediate size (Mixtral's experts use intermediate_size).
    expert_size_key: str = "moe_intermediate_size"
    # Every layer sparse (Mixtral); else decoder_sparse_step and mlp_only_layers pick them (Qwen).
    every_layer: bool = False
    norm_topk_prob: bool | str = "norm_topk_prob"  # renormalise the top-k routing weights
    # The Qwen families round the routing weights to the model dtype before weighting; Mixtral keeps float32.
    weights_in_model_dtype: bool = True
    shared_expert: bool = False  # Qwen2-MoE: a dense expert every token takes, gated by a sigmoid
    # The hub's per-expert tensor names (gate, up, down) under `mlp.` or `block_sparse_moe.`.
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    """The decoder layer's structure. Defaults are Llama's."""

    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    # "rms_one_plus": x / rms(x) * (1 + w) in float32 (Gemma); "rms": transformers' Llama RMSNorm.
    norm: Norm = "rms"
    # Norms on the attention's and the MLP's outputs too, before they join the residual stream (Gemma).
    sandwich_norms: bool = False
    activation_key: str = "hidden_act"  # the gated MLP's activation (silu, gelu_pytorch_tanh, gelu)
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the model dtype (Gemma)
    # config.json key of the scalar whose -1/2 power scales attention scores; None: head_dim.
    attn_scale_key: str | None = None
    attn_softcap_key: str | None = None  # scores become cap * tanh(score / cap) before the softmax
    final_softcap_key: str | None = None  # the same on the output logits
    # Which layers slide (`sliding_window` tokens); layer_types in config.json wins where the
    # family reads windows at all. "pattern": every `window_pattern`-th layer is global;
    # "switched": every layer, but only when use_sliding_window is set; "max_window_layers": with
    # it set, the layers from max_window_layers up; "odd_below_max_window_layers": with it set,
    # every other layer (the first, third, ...) below max_window_layers.
    windows: Windows = "max_window_layers"
    window_pattern: int = 0
    local_rope: bool = False  # the sliding layers rotate with a rope of their own (Gemma 3)
    # The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3).
    fused_checkpoint: bool = False
    moe: MoeRecipe | None = None


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json `architectures` entry, e.g. "LlamaForCausalLM"
    model_type: str  # config.json `model_type` (configs built in code may lack `architectures`)
    recipe: Recipe = Recipe()
    # What transformers' config class assumes for keys config.json may leave out.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Other names config.json may use for a key (transformers' attribute_map): alias -> key.
    aliases: Mapping[str, str] = field(default_factory=dict)
