"""Qwen3: Llama with a per-head RMSNorm on q and k."""

from noria.protocol.recipe import Family, Recipe

FAMILY = Family("Qwen3ForCausalLM", "qwen3", Recipe(qk_norm=True),
                defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                          "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 32, "head_dim": 128,
                          "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                          "max_window_layers": 28})
