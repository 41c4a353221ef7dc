"""Qwen3-MoE: Qwen3's attention (q/k norm), sparse layers, every layer windowed when
use_sliding_window is set."""

from noria.protocol.recipe import Family, MoeRecipe, Recipe

FAMILY = Family(
    "Qwen3MoeForCausalLM", "qwen3_moe",
    Recipe(qk_norm=True, windows="switched", moe=MoeRecipe(experts_key="num_local_experts")),
    defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
              "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "num_local_experts": 128,
              "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": False,
              "decoder_sparse_step": 1},
    aliases={"num_experts": "num_local_experts"})
