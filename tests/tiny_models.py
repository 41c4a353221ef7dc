"""Tiny seeded random checkpoints of the supported architectures, for tests.

Plain functions (no pytest), so any test can build a checkpoint folder:

    path = make_checkpoint("qwen3", tmp_path / "qwen3", tied=True, shard=True)

The folders hold config.json + safetensors weights exactly as `save_pretrained`
writes them; no tokenizer. Weights come from transformers' own initialization
under `torch.manual_seed(seed)`, with a larger initializer range than the
default so that attention and context visibly change the greedy output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# "llama3" is Llama with Llama 3.1 rope scaling; kept apart from ARCHS so the
# four families stay the default set.
ALL_ARCHS = (*ARCHS, "llama3")
# Mixture-of-experts families, apart from ARCHS so that the dense tests keep their set.
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
# Gemma 2 / 3 (text), apart for the same reason; tests/test_gemma.py runs them.
GEMMA_ARCHS = ("gemma2", "gemma3")

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
}


def tiny_config(arch: str, *, tied: bool = False, **overrides: Any) -> Any:
    """A transformers config for a tiny model of `arch` (one of ALL_ARCHS)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kwargs: dict[str, Any] = {**_COMMON, "tie_word_embeddings": tied}
    if arch in ("llama", "llama3"):
        cls: Any = LlamaConfig
        if arch == "llama3":
            kwargs["rope_parameters"] = {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small enough that some of the tiny model's frequencies get scaled.
                "original_max_position_embeddings": 64,
            }
    elif arch == "mistral":
        cls = MistralConfig
        # A window shorter than the longer test prompts exercises window masking.
        kwargs["sliding_window"] = 48
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        # head_dim deliberately differs from hidden_size / num_attention_heads.
        kwargs["head_dim"] = 32
    elif arch == "phi3":
        from transformers import Phi3Config

        # Fused qkv_proj / gate_up_proj, rotary on half of each head's 16 dims, and longrope
        # whose short and long factors differ in every frequency.
        cls = Phi3Config
        kwargs["pad_token_id"] = 0
        kwargs["original_max_position_embeddings"] = 256
        kwargs["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
    elif arch in MOE_ARCHS:
        cls, extra = _moe_config(arch)
        kwargs.update(extra)
    elif arch in GEMMA_ARCHS:
        cls, extra = _gemma_config(arch)
        kwargs.update(extra)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ALL_ARCHS}")
    cfg = cls(**{**kwargs, **overrides})
    return cfg


def _moe_config(arch: str) -> tuple[Any, dict[str, Any]]:
    """8 experts, top-2, each family with what sets it apart: Mixtral every layer sparse, always
    renormalised, with a sliding window; Qwen2-MoE a shared expert with its sigmoid gate and raw
    top-k weights; Qwen3-MoE renormalised, q/k norm, a dense first layer (`mlp_only_layers`)
    whose MLP is wider than the experts."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "mixtral":
        # intermediate_size is each expert's here.
        return MixtralConfig, {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
                               "sliding_window": 48}
    if arch == "qwen2_moe":
        return Qwen2MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "norm_topk_prob": False}
    return Qwen3MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "norm_topk_prob": True, "mlp_only_layers": [0], "head_dim": 32}


def _gemma_config(arch: str) -> tuple[Any, dict[str, Any]]:
    """Three layers, sliding / global / sliding, with a window (20) shorter than the longer test
    prompts; head_dim 32 (not hidden / heads) and query_pre_attn_scalar 24 (not head_dim), so a
    wrong attention scale shows. Gemma 2 soft-caps attention logits at 1.0, small enough to
    change the greedy tokens (its final cap, 3.0, cannot change an argmax: logprobs show it).
    Gemma 3's sliding layers rotate with a base of 100, its global ones with linear-scaled rope."""
    from transformers import Gemma2Config, Gemma3TextConfig

    common = {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 20,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "pad_token_id": 0}
    if arch == "gemma2":
        return Gemma2Config, {**common, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
    return Gemma3TextConfig, {**common, "final_logit_softcapping": 3.0, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}


def make_model(arch: str, *, tied: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """The transformers model (float32, eval mode) with seeded random weights."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, tied=tied, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch in GEMMA_ARCHS:
        # transformers starts Gemma's (1 + w) norms at w = 0, which would hide a norm that
        # forgets the 1, or one applied in the wrong place.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.5)
    return model.eval()


def make_checkpoint(
    arch: str,
    path: str | Path,
    *,
    tied: bool = False,
    shard: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a tiny seeded `arch` checkpoint into `path` and return it.

    `shard=True` splits the weights over several files with an index
    (model.safetensors.index.json); `tied=True` ties lm_head to the embeddings,
    so the checkpoint has no lm_head tensor.
    """
    path = Path(path)
    if arch == "mimo":  # not in transformers: Qwen2's decoder, with an MTP layer beside it
        make_checkpoint("qwen2", path, tied=tied, shard=shard, seed=seed, **overrides)
        from noria.bench.spec_models import add_mtp_layer

        return add_mtp_layer(path, seed=seed + 7)
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = make_model(arch, tied=tied, seed=seed, **overrides)
    model.save_pretrained(str(path), max_shard_size="100KB" if shard else "50GB")
    return path


def load_reference(path: str | Path) -> Any:
    """Load a checkpoint folder with transformers for reference outputs (EOS disabled)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no EOS stop)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
