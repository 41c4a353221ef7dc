"""The roofline arithmetic of `noria bench gpu` (pure): what a model's forward pass must read and
compute, and the floors that follow for a decode step, a prefill and a whole offline workload."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from noria.bench.roofline import config_spec
from noria.protocol.model_spec import ModelSpec


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every parameter, read once per forward pass
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: int  # 2 x the parameters a token multiplies through (the embedding is a lookup)
    attn_flops_per_pair: int  # QK^T and PV for one (query, key) pair over all layers


def model_cost(model: ModelSpec | Mapping[str, Any], dtype_bytes: int = 2, linear_bits: int | None = None,
               scale_group: int | None = None) -> ModelCost:
    """`model`: a spec, or a config dict (a bare dict of sizes is Llama's, see config_spec).
    `linear_bits`: the decoder layers' linear weights quantized to this many bits with a float32
    scale per `scale_group` weights of a row (None: one per row); the embedding, the lm_head and
    the norms stay in `dtype_bytes`, as --quantization fp8 and compressed-tensors' W4A16 keep them."""
    spec = config_spec(model)
    h, layers, inter, vocab = spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.vocab_size
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter
    matmul_params = layers * per_layer + vocab * h  # lm_head
    params = matmul_params + (0 if spec.tie_word_embeddings else vocab * h) + (2 * layers + 1) * h
    weight_bytes = params * dtype_bytes
    if linear_bits is not None:
        linear = layers * per_layer
        scale_bytes = linear * 4 / (scale_group or h)
        weight_bytes = round((params - linear) * dtype_bytes + linear * linear_bits / 8 + scale_bytes)
    return ModelCost(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
        flops_per_token=2 * matmul_params,
        attn_flops_per_pair=4 * layers * heads * head_dim,
    )


def decode_step_floor(cost: ModelCost, contexts: Sequence[int], gbps: float) -> float:
    """Seconds a decode step over sequences of these context lengths must take at `gbps`:
    the weights once plus every sequence's K/V."""
    return (cost.weight_bytes + sum(contexts) * cost.kv_bytes_per_token) / (gbps * 1e9)


def prefill_floor(cost: ModelCost, prompt: int, gbps: float, tflops: float | None) -> tuple[float, str]:
    """(seconds, "memory" or "compute") for one prompt's prefill: the weights read and its K/V
    written, or its matmul FLOPs (causal attention counted) at `tflops`, whichever is slower."""
    memory = (cost.weight_bytes + prompt * cost.kv_bytes_per_token) / (gbps * 1e9)
    if not tflops:
        return memory, "memory"
    flops = prompt * cost.flops_per_token + cost.attn_flops_per_pair * prompt * (prompt + 1) / 2
    compute = flops / (tflops * 1e12)
    return (compute, "compute") if compute > memory else (memory, "memory")


def throughput_ceiling(cost: ModelCost, requests: int, prompt: int, output: int, max_batch: int, gbps: float,
                       tflops: float | None) -> float:
    """Output tokens/s no engine can beat on this workload: the requests in waves of `max_batch`,
    each wave's prefills at their floor, then `output` decode steps (the first token comes from
    the prefill) over contexts that grow by one a step."""
    total, left = 0.0, requests
    while left > 0:
        b = min(left, max_batch)
        total += b * prefill_floor(cost, prompt, gbps, tflops)[0]
        total += sum(decode_step_floor(cost, [prompt + s] * b, gbps) for s in range(1, output))
        left -= b
    return requests * output / total


def itl_floor(cost: ModelCost, batch: int, context: int, gbps: float) -> float:
    return decode_step_floor(cost, [context] * batch, gbps)
