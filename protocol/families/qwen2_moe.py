"""Qwen2-MoE: Qwen2's attention (q/k/v biases per `qkv_bias`), sparse layers with a shared
expert gated by a sigmoid."""

from noria.protocol.recipe import Family, MoeRecipe, Recipe

FAMILY = Family(
    "Qwen2MoeForCausalLM", "qwen2_moe",
    Recipe(qkv_bias="qkv_bias", o_bias=False, windows="odd_below_max_window_layers",
           moe=MoeRecipe(shared_expert=True)),
    defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
              "num_attention_heads": 16, "num_key_value_heads": 16, "qkv_bias": True,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "max_window_layers": 28,
              "num_experts": 60, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
              "norm_topk_prob": False, "decoder_sparse_step": 1})
