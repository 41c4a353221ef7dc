"""Quantized mixture-of-experts layers: which scheme each sparse layer's experts take, torch-free.

Every format noria reads for dense layers stores a quantized MoE checkpoint's experts as one
linear module per expert and part (`mlp.experts.E.gate_proj`, Mixtral's
`block_sparse_moe.experts.E.w1`), so each expert is a quantized linear layer like a dense
MLP's (worker/models/moe_quant.py). The router (`gate`) and Qwen2-MoE's `shared_expert_gate`
stay float, as vLLM keeps them (no format quantizes a layer of so few rows); the shared
expert is a dense MLP and takes its modules' schemes.

What no kind computes is refused here in one sentence, before a weight is read: a GGUF file's
experts (stored fused per layer in blocks, a reader noria lacks), and one layer's experts
quantized differently from each other (the block runs one kind of layer for all of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from noria.protocol.quant_config import QuantSpec, WeightScheme

if TYPE_CHECKING:
    from noria.protocol.model_spec import ModelSpec

ExpertSchemes = tuple[WeightScheme | None, WeightScheme | None]  # (gate/up, down); None: float


def check_quantized_moe(quant: QuantSpec, architecture: str) -> None:
    """ValueError, in one sentence, for a quantization method whose experts no kind reads."""
    if quant.method == "gguf":
        raise ValueError(f"GGUF mixture-of-experts models ({architecture}) are not supported yet: their experts "
                         "are stored fused per layer in GGUF blocks; use a safetensors checkpoint (compressed-"
                         "tensors, FP8, AWQ or GPTQ)")


def expert_block(spec: ModelSpec) -> str:
    """The module below `layers.N.` that holds the experts in quantized checkpoints: Mixtral's
    hub name, `block_sparse_moe` (its w1/w2/w3 parts), else `mlp`."""
    return "block_sparse_moe" if spec.expert_parts == ("w1", "w3", "w2") else "mlp"


def expert_module(spec: ModelSpec, layer: int, expert: int, part: str) -> str:
    """A checkpoint module's name, as quantization configs name it ("model.layers.1.mlp.experts.3.up_proj")."""
    return f"model.layers.{layer}.{expert_block(spec)}.experts.{expert}.{part}"


def expert_schemes(spec: ModelSpec, layer: int) -> ExpertSchemes:
    """The schemes of a sparse layer's experts (every expert's the same: ValueError otherwise)."""
    quant = spec.quantization
    if quant is None:
        return None, None
    gate, up, down = spec.expert_parts
    found: dict[ExpertSchemes, int] = {}
    for e in range(spec.num_experts):
        gate_up = quant.fused_scheme([expert_module(spec, layer, e, gate), expert_module(spec, layer, e, up)])
        found.setdefault((gate_up, quant.scheme_for(expert_module(spec, layer, e, down))), e)
    if len(found) > 1:
        detail = "; ".join(f"expert {e}: {_name(s[0])} gate/up, {_name(s[1])} down" for s, e in found.items())
        raise ValueError(f"the experts of layer {layer} are quantized differently ({detail}); noria runs one "
                         "kind of layer for every expert of a layer")
    return next(iter(found))


def _name(scheme: WeightScheme | None) -> str:
    return "float" if scheme is None else scheme.name + ("" if scheme.group is None else f" g{scheme.group}")


def check_experts(spec: ModelSpec) -> None:
    """Every sparse layer's experts take one scheme (ValueError naming the first that does not)."""
    for i in range(spec.num_layers):
        if spec.is_sparse(i):
            expert_schemes(spec, i)
