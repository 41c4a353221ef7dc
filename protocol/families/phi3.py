"""Phi-3: Llama's layer from a checkpoint with q/k/v and gate/up stored fused; partial rotary
and longrope come through its rope."""

from noria.protocol.recipe import Family, Recipe

FAMILY = Family("Phi3ForCausalLM", "phi3",
                Recipe(qkv_bias=False, o_bias=False, windows="every", fused_checkpoint=True),
                defaults={"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                          "num_hidden_layers": 32, "num_attention_heads": 32,
                          "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                          "original_max_position_embeddings": 4096})
