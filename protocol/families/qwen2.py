"""Qwen2: q/k/v biases (never o_proj's); windows from layer max_window_layers up."""

from noria.protocol.recipe import Family, Recipe

FAMILY = Family("Qwen2ForCausalLM", "qwen2", Recipe(qkv_bias=True, o_bias=False),
                defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                          "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 32768, "max_window_layers": 28})
