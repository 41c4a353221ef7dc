"""Which decoder layers the native CPU stack (worker/native_stack.py) runs, and why not the others.

The answer comes from the model's spec, its family's recipe resolved: each ModelSpec field
the driver depends on is listed in `_RECIPE` with what it must be, and every other field is
one the driver need not know (sizes, the embedding's scale and the final soft-cap, which live
outside the layers, how the checkpoint names its tensors). A field added to the spec and not
listed declines the stack, by name, wherever it is away from its default, until the driver
learns it. Besides the recipe, facts of the running engine: the build, the ranks, the dtype
and device, each layer's linear kinds (packed for the native GEMM) and its KV cache.
tests/test_worker_native_stack.py runs every supported family and fails if one falls off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from noria.protocol.model_spec import ModelSpec
from noria.worker import cpu_kernels
from noria.worker.models.linear import LinearOp, PackedHalfLinear, PackedLinear, panels
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.rope import rotary_dim

if TYPE_CHECKING:
    from noria.worker.models.causal_lm import CausalLM
    from noria.worker.models.decoder import DecoderLayer


def _softcap(spec: ModelSpec) -> str | None:
    cap = spec.attn_softcap
    return None if cap is None or cap > 0 else f"attention soft-cap {cap!r}: a cap must be positive"


def _rotary(spec: ModelSpec) -> str | None:
    rot = rotary_dim(spec.rope, spec.head_dim)
    if spec.qk_norm and rot != spec.head_dim:
        return "per-head q/k norm with partial rotary: its fused kernel rotates whole heads"
    if spec.local_rope is not None and rotary_dim(spec.local_rope, spec.head_dim) != rot:
        return (f"the sliding layers' rope rotates {rotary_dim(spec.local_rope, spec.head_dim)} dims per head, "
                f"the others' {rot}")
    return None


# The recipe entries the driver runs: field -> the reason it cannot, or None.
_RECIPE: dict[str, Callable[[ModelSpec], str | None]] = {
    "norm": lambda s: None if s.norm in ("rms", "rms_one_plus") else f"norm {s.norm!r}",
    "activation": lambda s: None if s.activation in ("silu", "gelu_tanh") else
    f"activation {s.activation!r}: the driver's gated activations are silu and the tanh GeGLU",
    "attn_softcap": _softcap,
    "qk_norm": _rotary,
    "rope": _rotary,
    "local_rope": _rotary,
    "quantization": lambda s: None,  # its kinds say: a layer whose kind the driver has no entry for is declined
}
# Fields the driver reads as they are (sizes, biases, windows, the post-norms, the scale) or
# need not know: outside the layers, or the checkpoint's naming, or a sparse layer's own block, or
# the MTP layers beside the decoder (the mtp drafter's).
_OUTSIDE = {"architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "qkv_bias", "o_bias", "mlp_bias", "sliding_windows", "dtype", "context_length", "sandwich_norms",
            "embed_scale", "attn_scale", "final_softcap", "fused_checkpoint", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
            "router_weights_in_model_dtype", "sparse_layers", "expert_parts", "mtp_layers"}


def recipe_reason(spec: ModelSpec) -> str | None:
    """Why the driver cannot run this model's layers, from its spec alone; None when it can."""
    for f in dataclasses.fields(spec):
        if f.name in _RECIPE:
            why = _RECIPE[f.name](spec)
            if why:
                return why
        elif f.name not in _OUTSIDE:
            value = getattr(spec, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if value != default:
                return f"ModelSpec.{f.name}={value!r}"
    return None


def coverage(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str | None]:
    """Per layer, None where the driver runs it, else why not (fixed for the model's lifetime
    with these caches)."""
    from noria.worker import cpu_ops, native_stack

    layers = list(model.layers)
    why = None
    if native_stack.load() is None:
        why = cpu_ops.paths()["stack"].removeprefix("torch (").removesuffix(")")  # its switch, or no compiler
    why = why or _model_reason(model, kv_caches)
    if why is not None:
        return [why] * len(layers)
    # The driver's GEMM is one per model: the linear kind of the first layer.
    kind = _gemm(layers[0].self_attn.qkv_proj.op) if layers else PackedLinear.kind
    return [_layer_reason(layer, kv_caches[i], kind) for i, layer in enumerate(layers)]


def _model_reason(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    if model.tp.size != 1:
        return f"tensor parallel over {model.tp.size} ranks"
    w = model.norm.weight  # the activations' dtype (the embedding table may be narrower)
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return f"{str(w.dtype).removeprefix('torch.')} on {w.device.type}: the driver is float32 on the CPU"
    if len(kv_caches) != len(model.layers):
        return "no KV cache per layer"
    dtypes = sorted({str(c.dtype).removeprefix("torch.") for pair in kv_caches for c in pair})
    if len(dtypes) > 1:  # the driver calls one attention kernel, for one cache dtype
        return f"KV caches of several dtypes ({', '.join(dtypes)})"
    if model.ops.name != "cpu":
        return f"the layers run the {model.ops.name} ops, not the native CPU kernels the driver calls"
    return recipe_reason(model.spec)


QUANTIZED = "quantized (each layer's descriptor)"


def _gemm(op: LinearOp) -> str:
    """Which GEMM reads a packed kind's panels (the bf16 kind has two layouts); every quantized
    kind is read through one entry that dispatches on the layer's descriptor."""
    if getattr(op, "desc_ptr", None) is not None:
        return QUANTIZED
    return f"{op.kind} ({op.packed.kind})" if isinstance(op, PackedHalfLinear) else op.kind


def _layer_reason(layer: DecoderLayer, cache: tuple[torch.Tensor, torch.Tensor], kind: str) -> str | None:
    at, mlp = layer.self_attn, layer.mlp
    linears = {"qkv": at.qkv_proj, "o": at.o_proj}
    if not isinstance(mlp, SparseMoeBlock):  # a sparse layer's block is called back as it is
        linears |= {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    # The driver calls each kind on the layer's input as it is; GPTQ's activation order needs it permuted.
    permuted = [name for name, linear in linears.items() if getattr(linear, "input_perm", None) is not None]
    if permuted:
        return f"{', '.join(permuted)} permute their input features (GPTQ desc_act)"
    unpacked = [name for name, linear in linears.items() if panels(linear.op) is None]
    if unpacked:
        return f"{', '.join(unpacked)} not packed for the native GEMM"
    other = [name for name, linear in linears.items() if _gemm(linear.op) != kind]
    if other:
        return f"{', '.join(other)} packed as {_gemm(linears[other[0]].op)}, the first layer's qkv as {kind}"
    k_cache, v_cache = cache
    a = at.attn
    if not (k_cache.dtype == v_cache.dtype and v_cache.is_contiguous()
            and cpu_kernels.fits(a.num_heads, a.head_dim, k_cache)):
        return (f"the attention kernel does not take {a.num_heads} heads of {a.head_dim} over "
                f"{a.num_kv_heads} KV heads in a {str(k_cache.dtype).removeprefix('torch.')} cache")
    return None


def describe(reasons: list[str | None]) -> str:
    """The start-up line: "native CPU stack: on for layers 4-27; off for layers 0-3 (...), ..."."""
    n = len(reasons)
    if n and all(r is None for r in reasons):
        return f"native CPU stack: on for all {n} layers"
    if n and len(set(reasons)) == 1:
        return f"native CPU stack: off ({reasons[0]})"
    if not n:
        return "native CPU stack: off (no decoder layers)"
    on = [start for start, end, native in segments(reasons) for start in range(start, end) if native]
    off: dict[str, list[int]] = {}
    for i, r in enumerate(reasons):
        if r is not None:
            off.setdefault(r, []).append(i)
    text = "; ".join(f"{_layers(v)} ({k})" for k, v in off.items())
    return f"native CPU stack: on for {_layers(on)}; off for {text}"


def segments(reasons: list[str | None]) -> list[tuple[int, int, bool]]:
    """Maximal runs (start, end, native) of the layers."""
    out: list[tuple[int, int, bool]] = []
    for i, r in enumerate(reasons):
        native = r is None
        if out and out[-1][2] == native:
            out[-1] = (out[-1][0], i + 1, native)
        else:
            out.append((i, i + 1, native))
    return out


def _layers(indices: list[int]) -> str:
    return f"layer{'s' if len(indices) > 1 else ''} {_ranges(indices)}"


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for i in indices:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)
