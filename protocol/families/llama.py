"""Llama 2 / 3: the reference recipe (every Recipe default is Llama's)."""

from noria.protocol.recipe import Family, Recipe

FAMILY = Family("LlamaForCausalLM", "llama", Recipe(mlp_bias="mlp_bias", windows="none"),
                defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                          "num_hidden_layers": 32, "num_attention_heads": 32,
                          "rms_norm_eps": 1e-6, "max_position_embeddings": 2048})
