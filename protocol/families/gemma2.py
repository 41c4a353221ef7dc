"""Gemma 2: (1 + w) norms before and after attention and MLP, GeGLU, scaled embeddings, scores
scaled by query_pre_attn_scalar and soft-capped, soft-capped logits; sliding and global
layers alternate."""

from dataclasses import replace

from noria.protocol.recipe import Family, Recipe

GEMMA = Recipe(norm="rms_one_plus", sandwich_norms=True, activation_key="hidden_activation", embed_scale=True,
               attn_scale_key="query_pre_attn_scalar", final_softcap_key="final_logit_softcapping",
               windows="pattern")

FAMILY = Family(
    "Gemma2ForCausalLM", "gemma2",
    replace(GEMMA, attn_softcap_key="attn_logit_softcapping", window_pattern=2),
    defaults={"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 8192, "tie_word_embeddings": True,
              "sliding_window": 4096, "query_pre_attn_scalar": 256,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
