"""Gemma 3 (text): Gemma 2's layer with a (1 + w) RMSNorm on q and k per head, no score
soft-cap (transformers reads attn_logit_softcapping but never applies it), and a rope of the
sliding layers' own."""

from dataclasses import replace

from noria.protocol.families.gemma2 import GEMMA
from noria.protocol.recipe import Family

FAMILY = Family(
    "Gemma3ForCausalLM", "gemma3_text",
    replace(GEMMA, qk_norm=True, window_pattern=6, local_rope=True),
    defaults={"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 131072, "tie_word_embeddings": True,
              "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_theta": 1e6,
              "rope_local_base_freq": 10000.0})
