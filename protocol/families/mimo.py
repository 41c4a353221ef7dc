"""MiMo (Xiaomi): Qwen2's decoder, plus `num_nextn_predict_layers` MTP layers stored beside it
(`model.mtp_layers.N.*`), which only `{"method": "mtp"}` speculation reads (worker/mtp.py)."""

from noria.protocol.families.qwen2 import FAMILY as QWEN2
from noria.protocol.recipe import Family

FAMILY = Family("MiMoForCausalLM", "mimo", QWEN2.recipe, defaults={**QWEN2.defaults, "num_nextn_predict_layers": 1})
