"""Mixtral: Mistral's attention, every layer's MLP a mixture of experts (w1 = gate, w3 = up,
w2 = down; intermediate_size is each expert's; top-k weights renormalised, kept in float32)."""

from noria.protocol.recipe import Family, MoeRecipe, Recipe

FAMILY = Family(
    "MixtralForCausalLM", "mixtral",
    Recipe(qkv_bias=False, o_bias=False, windows="every",
           moe=MoeRecipe(experts_key="num_local_experts", expert_size_key="intermediate_size", every_layer=True,
                         norm_topk_prob=True, weights_in_model_dtype=False, parts=("w1", "w3", "w2"))),
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "rope_theta": 1e6, "num_local_experts": 8,
              "num_experts_per_tok": 2},
    aliases={"num_experts": "num_local_experts"})
