"""Mistral: Llama without biases, every layer windowed when sliding_window is set."""

from noria.protocol.recipe import Family, Recipe

FAMILY = Family("MistralForCausalLM", "mistral", Recipe(qkv_bias=False, o_bias=False, windows="every"),
                defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                          "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "sliding_window": 4096,
                          "rms_norm_eps": 1e-6, "max_position_embeddings": 131072})
