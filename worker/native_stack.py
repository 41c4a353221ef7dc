"""A model's decoder layers in one native call per step (worker/csrc/decoder_f32.c).

The C driver calls the same kernels as the modules' Python path, in the same
order, on the same inputs, so its output is bit for bit theirs; what it removes
is the Python between them (wrappers, ctypes conversions, a tensor per result).
It runs the layers built exactly as the Llama family's (Qwen3's per-head q/k norm,
Phi-3's partial rotary included) or as Gemma 2 / 3's (worker/models/gemma.py) on those
kernels: float32 on the CPU, one rank, packed native GEMM weights, and a step whose
attention is one call of the paged kernel per layer (decode rows, or short prompts as
rows: `TorchAttentionBackend.paged_rows`). A mixture-of-experts layer (Mixtral, Qwen2-MoE,
Qwen3-MoE) runs its attention on the driver too; its MLP is the layer's own SparseMoeBlock,
called back from the driver on the driver's normed rows (its experts one native call).
`coverage` says, per layer, why not where it does not; those layers run in Python
between the driver's runs of the others, and the worker logs `describe`'s line at
start-up. worker/cpu_ops.py decides whether it is on (NORIA_DISABLE_CPU_STACK=1: off).
"""

from __future__ import annotations

import ctypes
import dataclasses
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from noria.worker import cpu_kernels, fused_kernels, gemm_kernels
from noria.worker.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from noria.worker.cpu_ops import disabled
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.native_build import build

if TYPE_CHECKING:
    from noria.worker.models.llama import LlamaForCausalLM

_SRC = Path(__file__).parent / "csrc" / "decoder_f32.c"
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [("gemm", _P), ("norm", _P), ("rope", _P), ("silu", _P), ("attn", _P), ("qk_rope", _P),
                ("rope_partial", _P), ("gelu_tanh", _P), ("attn_capped", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
                                        "down_bias", "input_norm", "post_norm", "k_cache", "v_cache")]
    _fields_ += [("window", _I64), ("q_norm", _P), ("k_norm", _P)]
    _fields_ += [("post_attn_norm", _P), ("post_mlp_norm", _P), ("soft_cap", ctypes.c_float),
                 ("geglu", ctypes.c_int32), ("local_rope", _I64)]
    _fields_ += [("moe", _P), ("index", _I64)]


# A sparse layer's MLP as the driver calls it: (layer index, rows) -> 0, or nonzero on failure.
_MOE_CALL = ctypes.CFUNCTYPE(ctypes.c_int, _I64, _I64)


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("max_blocks", _I64)]
    _fields_ += [(name, _P) for name in ("cos", "sin", "tables", "lens", "slots", "normed", "qkv", "q", "k", "v",
                                         "attn", "gate_up", "act")]
    _fields_ += [("num_threads", ctypes.c_int), ("residual", ctypes.c_int), ("rotary_dim", _I64)]
    _fields_ += [("cos_local", _P), ("sin_local", _P)]


@cache
def load() -> tuple[ctypes.CDLL, _Kernels] | None:
    if disabled("stack"):
        return None
    gemm, fused, attn = gemm_kernels.load(), fused_kernels.load(), cpu_kernels.load()
    dll = build(_SRC, ["-O2", "-shared", "-fPIC"])
    if dll is None or gemm is None or fused is None or attn is None:
        return None
    dll.decoder_stack.argtypes = [_P, _P, _I64, _P, _P, _P, _P]
    dll.decoder_stack.restype = ctypes.c_int

    def addr(fn: ctypes._CFuncPtr) -> int:
        return ctypes.cast(fn, _P).value or 0

    kernels = _Kernels(addr(gemm.gemm_f32), addr(fused.add_rms_norm), addr(fused.rope_split),
                       addr(fused.silu_mul), addr(attn.paged_decode_f32), addr(fused.qk_norm_rope_split),
                       addr(fused.rope_split_partial), addr(fused.gelu_tanh_mul),
                       addr(attn.paged_decode_capped_f32))
    return dll, kernels


class NativeStack:
    """One model's layers as the C driver sees them, for one set of KV caches.

    `segments` cuts the layers into runs, each all native or all Python (the layers
    `coverage` declines, with the reason why), in order."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 reasons: list[str | None]) -> None:
        first = model.layers[reasons.index(None)]
        self.dims = _layer_dims(model, first)
        self.shape = _Shape(*self.dims, kv_caches[0][0].shape[1], first.input_layernorm.eps,
                            first.self_attn.attn.scale)
        self.segments = _segments(reasons)
        self.layer_runs = 0  # layers the driver ran, over this stack's life
        self._capacity, self._buffers = 0, []
        # Biases the driver reads: contiguous copies, kept alive here.
        self._keep: list[torch.Tensor] = []
        # The sparse layers' blocks, the callback the driver calls them through, and while the
        # driver runs, its normed rows and output (`run`) and the failure of a block's call.
        self._moe_blocks: dict[int, torch.nn.Module] = {}
        self._moe_call = _MOE_CALL(self._run_moe)
        self._io: tuple[torch.Tensor, torch.Tensor] | None = None
        self._moe_error: BaseException | None = None
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            if reasons[i] is not None:
                continue  # zeros: never passed to the driver
            at, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_caches[i]
            q_norm, k_norm = (None, None) if at.q_norm is None else (at.q_norm.weight.data_ptr(),
                                                                      at.k_norm.weight.data_ptr())
            gemma = model.spec.gemma is not None  # `coverage` checked the layer is built as Gemma's
            # The norm before the MLP: a Gemma layer's post-attention norm is on the attention's output.
            mlp_norm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            self.layers[i] = _Layer(
                _packed(at.qkv_packed), self._bias(at.qkv_bias), _packed(at.o_packed), self._bias(at.o_bias),
                _packed(mlp.gate_up_packed), self._bias(getattr(mlp, "gate_up_bias", None)),
                _packed(mlp.down_packed), self._bias(getattr(mlp, "down_bias", None)), layer.input_layernorm.weight.data_ptr(), mlp_norm.weight.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), at.attn.sliding_window or 0, q_norm, k_norm)
            if _is_moe(mlp):
                self._moe_blocks[i] = mlp
                self.layers[i].moe = ctypes.cast(self._moe_call, _P).value
                self.layers[i].index = i
            if gemma:
                self.layers[i].post_attn_norm = layer.post_attention_layernorm.weight.data_ptr()
                self.layers[i].post_mlp_norm = layer.post_feedforward_layernorm.weight.data_ptr()
                self.layers[i].soft_cap = at.attn.logits_soft_cap or 0.0
                self.layers[i].geglu = 1
                self.layers[i].local_rope = int(layer.sliding and model.local_rotary is not None)

    def _scratch(self, tokens: int) -> list[torch.Tensor]:
        """Flat buffers for `tokens` rows (normed, qkv, q, k, v, attn, gate_up, act, other), kept
        across steps: a fresh tensor per result, as the Python path makes, costs page faults
        from a few hundred rows up (each allocation that size is a fresh mapping)."""
        if tokens > self._capacity:
            self._capacity = max(tokens, 2 * self._capacity)
            hidden, heads, kv_heads, head_dim, inter = self.dims
            widths = (hidden, (heads + 2 * kv_heads) * head_dim, heads * head_dim, kv_heads * head_dim,
                      kv_heads * head_dim, heads * head_dim, 2 * inter, inter, hidden)
            self._buffers = [torch.empty(self._capacity * w, dtype=torch.float32) for w in widths]
        return self._buffers

    def _bias(self, b: torch.Tensor | None) -> int | None:
        if b is None:
            return None
        b = b.detach().contiguous()
        self._keep.append(b)
        return b.data_ptr()

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, rows: tuple[torch.Tensor, torch.Tensor], start: int,
            end: int, local: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers start..end-1 on the embedded tokens or the previous layer's output x [T, hidden]
        (contiguous; overwritten) and the residual stream (None before layer 0): (the last
        layer's output, the residual stream), as DecoderLayer.forward leaves them. `local`: the
        cos / sin of Gemma 3's sliding layers (their own rope), of the width of `cos`."""
        loaded = load()
        assert loaded is not None
        dll, kernels = loaded
        x = x.contiguous()
        hidden, heads, kv_heads, head_dim, inter = self.dims
        t = x.shape[0]
        tables, lens = (r.contiguous() for r in rows)
        slots = meta.slot_mapping.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_local, sin_local = (cos, sin) if local is None else (t.contiguous() for t in local)
        buf = self._scratch(t)
        other = buf[-1][: t * hidden].view(t, hidden)
        if residual is not None and residual.data_ptr() != other.data_ptr():
            other.copy_(residual)  # the driver writes the new stream over it
        step = _Step(t, tables.shape[1], cos.data_ptr(), sin.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                     slots.data_ptr(), *(b.data_ptr() for b in buf[:-1]), torch.get_num_threads(),
                     int(residual is not None), 2 * cos.shape[-1], cos_local.data_ptr(), sin_local.data_ptr())
        layers = ctypes.byref(self.layers, start * ctypes.sizeof(_Layer))
        self._io, self._moe_error = (buf[0][: t * hidden].view(t, hidden), x), None
        try:
            status = dll.decoder_stack(ctypes.byref(kernels), layers, end - start, ctypes.byref(self.shape),
                                       ctypes.byref(step), x.data_ptr(), other.data_ptr())
        finally:
            self._io = None
        if status == -2 and self._moe_error is not None:
            raise self._moe_error
        if status != 0:
            raise MemoryError("decoder_stack: no memory for the attention kernel's task list")
        self.layer_runs += end - start
        return x, other

    def _run_moe(self, index: int, tokens: int) -> int:
        """The driver's call of sparse layer `index` on its first `tokens` normed rows: the
        block's output into x. An exception cannot cross the C frames: it is kept for `run`."""
        try:
            assert self._io is not None
            normed, x = self._io
            x[:tokens].copy_(self._moe_blocks[index](normed[:tokens]))
            return 0
        except BaseException as e:  # noqa: BLE001 - re-raised by `run` once the driver has returned
            self._moe_error = e
            return 1


# The structure the driver runs, and nothing else: a layer is native only if it is built
# from exactly these classes, holds exactly these parameters, and every attribute,
# LayerAttention field or ModelSpec field the driver does not know is switched off (its
# dataclass default, or None / False / 0). A layer kind added to worker/models/ (experts,
# extra norms, soft-capping) is declined by that rule, with its name in the reason, until
# the driver learns it. Gemma 2 / 3 (worker/models/gemma.py) is the one other structure it
# knows: its own classes, two more norms, GeGLU (tanh), soft-capped scores, a local rope.
_PARAMS = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
           "input_layernorm.weight", "post_attention_layernorm.weight"}
_OPTIONAL_PARAMS = {"self_attn.qkv_bias", "self_attn.o_bias", "mlp.gate_up_bias", "mlp.down_bias"}
_QK_NORM_PARAMS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
_GEMMA_PARAMS = {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
_ATTRS = {"DecoderLayer": {"training"},
          "Attention": {"training", "layer_index", "tp", "q_size", "kv_size", "attn", "qkv_packed", "o_packed"},
          "MLP": {"training", "tp", "gate_up_packed", "down_packed"},
          "RMSNorm": {"training", "eps"}}
_ATTRS |= {"GemmaDecoderLayer": {"training", "sliding"}, "GemmaAttention": _ATTRS["Attention"],
           "GemmaMLP": _ATTRS["MLP"] | {"approximate"}, "GemmaRMSNorm": _ATTRS["RMSNorm"]}
_ATTENTION_FIELDS = {"num_heads", "num_kv_heads", "head_dim", "scale", "sliding_window"}
_GEMMA_ATTENTION_FIELDS = _ATTENTION_FIELDS | {"logits_soft_cap"}
# ModelSpec fields the layers' structure follows and the driver reads or handles (biases,
# q/k norm, windows, sizes); `rope` through the cos / sin it is given, whose width is checked.
_SPEC_FIELDS = {"architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "rope", "sliding_windows", "checkpoint_dtype"}
# ModelSpec fields read only by the mixture-of-experts block that takes a sparse layer's `mlp`:
# the driver calls that block back as it is, so they are its business alone.
_MOE_FIELDS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob", "router_weights_in_model_dtype", "sparse_layers"}


def coverage(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str | None]:
    """Per layer, None where the driver runs it, else why not (fixed for the model's lifetime
    with these caches)."""
    from noria.worker import cpu_ops

    layers = list(getattr(model, "layers", ()))
    if not layers:
        return []
    why = None
    if load() is None:
        why = cpu_ops.paths()["stack"].removeprefix("torch (").removesuffix(")")  # its switch, or no compiler
    why = why or _model_reason(model, kv_caches)
    if why is not None:
        return [why] * len(layers)
    reasons = [_layer_reason(model, layer, kv_caches[i]) for i, layer in enumerate(layers)]
    ref = next((i for i, r in enumerate(reasons) if r is None), None)
    if ref is not None:
        # The driver takes one shape for all its layers.
        want = _shape_key(model, layers[ref])
        reasons = [r if r is not None or _shape_key(model, layer) == want else f"shape differs from layer {ref}'s"
                   for r, layer in zip(reasons, layers, strict=True)]
    return reasons


def describe(reasons: list[str | None]) -> str:
    """The start-up line: "native CPU stack: on for layers 4-27; off for layers 0-3 (mlp is MoE), ..."."""
    n = len(reasons)
    if n and all(r is None for r in reasons):
        return f"native CPU stack: on for all {n} layers"
    if n and len(set(reasons)) == 1:
        return f"native CPU stack: off ({reasons[0]})"
    if not n:
        return "native CPU stack: off (no decoder layers)"
    on = [start for start, end, native in _segments(reasons) for start in range(start, end) if native]
    off: dict[str, list[int]] = {}
    for i, r in enumerate(reasons):
        if r is not None:
            off.setdefault(r, []).append(i)
    text = "; ".join(f"{_layers(v)} ({k})" for k, v in off.items())
    return f"native CPU stack: on for {_layers(on)}; off for {text}"


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


def _segments(reasons: list[str | None]) -> list[tuple[int, int, bool]]:
    """Maximal runs (start, end, native) of the layers."""
    out: list[tuple[int, int, bool]] = []
    for i, r in enumerate(reasons):
        native = r is None
        if out and out[-1][2] == native:
            out[-1] = (out[-1][0], i + 1, native)
        else:
            out.append((i, i + 1, native))
    return out


def _switched_off(value: object) -> bool:
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


def _unknown_fields(obj: object, known: set[str]) -> list[str]:
    """`name=value` for each dataclass field of obj outside `known` that is not at its default."""
    out = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if f.name in known:
            continue
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if not (value == default if default is not dataclasses.MISSING else _switched_off(value)):
            out.append(f"{type(obj).__name__}.{f.name}={value!r}")
    return out


def _model_reason(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    from noria.worker.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} has no native stack"
    if model.tp.size != 1:
        return f"tensor parallel over {model.tp.size} ranks"
    w = model.embed_tokens
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return f"{str(w.dtype).removeprefix('torch.')} on {w.device.type}: the driver is float32 on the CPU"
    if len(kv_caches) != len(model.layers):
        return "no KV cache per layer"
    # `gemma`: what Gemma adds, each part known: the scale and soft-cap through LayerAttention, the
    # activation and the local rope checked here, the embedding scale and final cap outside the layers.
    unknown = _unknown_fields(model.spec, _SPEC_FIELDS | _MOE_FIELDS | {"gemma"})
    if unknown:
        return ", ".join(unknown)
    rot = _rotary_dim(model)
    if rot % 2 or not 0 < rot <= model.spec.head_dim:
        return f"rotary on {rot} of {model.spec.head_dim} dims per head"
    gemma = model.spec.gemma
    if gemma is not None:
        if gemma.gelu_approximate != "tanh":
            return f"GeGLU with gelu approximate={gemma.gelu_approximate!r}: the driver's kernel is the tanh form"
        local = getattr(model, "local_rotary", None)
        if local is not None and _rotary_dim(model, local) != rot:
            return f"the sliding layers' rope rotates {_rotary_dim(model, local)} dims per head, the others' {rot}"
    return None


def _rotary_dim(model: LlamaForCausalLM, rotary: torch.nn.Module | None = None) -> int:
    """How many dims of each head rotate: twice the width of the cos / sin rows the layers get
    (from `rotary`, else the model's)."""
    cos, _ = (rotary or model.rotary).cos_sin(torch.zeros(1, dtype=torch.long), torch.float32)
    return 2 * cos.shape[-1]


def _layer_reason(model: LlamaForCausalLM, layer: torch.nn.Module,
                  cache: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    from noria.worker.models import gemma as gm
    from noria.worker.models.layers import RMSNorm
    from noria.worker.models.llama import MLP, Attention, DecoderLayer
    from noria.worker.models.moe import SparseMoeBlock

    # A Gemma model's layers are built from Gemma's classes, with two more norms.
    gemma = model.spec.gemma is not None
    layer_cls, attn_cls, mlp_cls, norm_cls = ((gm.GemmaDecoderLayer, gm.GemmaAttention, gm.GemmaMLP, gm.GemmaRMSNorm)
                                              if gemma else (DecoderLayer, Attention, MLP, RMSNorm))
    # A sparse layer's MLP is its block, called back as it is (its own parameters and switches).
    moe = not gemma and _is_moe(getattr(layer, "mlp", None))
    if moe:
        mlp_cls = SparseMoeBlock
    norm_names = ("input_layernorm", "post_attention_layernorm")
    if gemma:
        norm_names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    at, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = tuple(getattr(layer, name, None) for name in norm_names)
    expected = ((layer, layer_cls, "layer"), (at, attn_cls, "self_attn"), (mlp, mlp_cls, "mlp"),
                *((norm, norm_cls, name) for norm, name in zip(norms, norm_names, strict=True)))
    for module, cls, name in expected:
        if type(module) is not cls:
            return f"{name} is {type(module).__name__}"
    assert isinstance(at, Attention) and isinstance(mlp, SparseMoeBlock if moe else MLP)
    params = {name for name, _ in layer.named_parameters() if not (moe and name.startswith("mlp."))}
    qk_norm = at.q_norm is not None or at.k_norm is not None
    required = _PARAMS | (_QK_NORM_PARAMS if qk_norm else set()) | (_GEMMA_PARAMS if gemma else set())
    if moe:
        required -= {"mlp.gate_up_proj", "mlp.down_proj"}
    extra = sorted(params - required - _OPTIONAL_PARAMS)
    if extra:
        return f"parameters outside its structure: {', '.join(extra)}"
    missing = sorted(required - params)
    if missing:
        return f"missing parameters: {', '.join(missing)}"
    modules = [(layer, "layer"), (at, "self_attn"), *zip(norms, norm_names, strict=True)]
    if not moe:
        modules.append((mlp, "mlp"))
    if qk_norm and _rotary_dim(model) != at.attn.head_dim:
        return "per-head q/k norm with partial rotary: its fused kernel rotates whole heads"
    if qk_norm:
        for module, name in ((at.q_norm, "self_attn.q_norm"), (at.k_norm, "self_attn.k_norm")):
            if type(module) is not norm_cls:
                return f"{name} is {type(module).__name__}"
            modules.append((module, name))
    for module, name in modules:
        known = _ATTRS[type(module).__name__]
        for attr, value in vars(module).items():
            if not attr.startswith("_") and attr not in known and not _switched_off(value):
                return f"{name}.{attr}={value!r}"
    if isinstance(mlp, gm.GemmaMLP) and mlp.approximate != "tanh":
        return f"mlp.approximate={mlp.approximate!r}: the driver's GeGLU is the tanh form"
    unknown = _unknown_fields(at.attn, _GEMMA_ATTENTION_FIELDS if gemma else _ATTENTION_FIELDS)
    if unknown:
        return ", ".join(unknown)
    cap = at.attn.logits_soft_cap
    if cap is not None and not cap > 0:
        return f"LayerAttention.logits_soft_cap={cap!r}: a cap must be positive"
    packed = {"qkv": at.qkv_packed, "o": at.o_packed}
    if not moe:
        packed |= {"gate_up": mlp.gate_up_packed, "down": mlp.down_packed}
    unpacked = [name for name, p in packed.items() if not isinstance(p, PackedWeight)]
    if unpacked:
        return f"{', '.join(unpacked)} not packed for the native GEMM"
    layer_norms = [n for n in (*norms, at.q_norm, at.k_norm) if isinstance(n, RMSNorm)]
    if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in layer_norms):
        return "norm weights not float32 and contiguous"
    if len({n.eps for n in layer_norms}) != 1:
        return "norms with different eps"
    k_cache, v_cache = cache
    if not (k_cache.dtype == v_cache.dtype == torch.float32 and v_cache.is_contiguous()
            and cpu_kernels.fits(at.attn.num_heads, at.attn.head_dim, k_cache)):
        return (f"the attention kernel does not take {at.attn.num_heads} heads of {at.attn.head_dim} over "
                f"{at.attn.num_kv_heads} KV heads in a {str(k_cache.dtype).removeprefix('torch.')} cache")
    return None


def _shape_key(model: LlamaForCausalLM, layer: torch.nn.Module) -> tuple[object, ...]:
    return (*_layer_dims(model, layer), layer.input_layernorm.eps, layer.self_attn.attn.scale)


def _layer_dims(model: LlamaForCausalLM, layer: torch.nn.Module) -> tuple[int, int, int, int, int]:
    """(hidden, heads, KV heads, head size, intermediate) of one decoder layer."""
    a = layer.self_attn.attn
    # A sparse layer has no dense MLP of its own: the model's dense size keeps its shape the dense layers'.
    inter = model.spec.intermediate_size if _is_moe(layer.mlp) else layer.mlp.gate_up_proj.shape[0] // 2
    return model.spec.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, inter


def _is_moe(mlp: object) -> bool:
    from noria.worker.models.moe import SparseMoeBlock

    return type(mlp) is SparseMoeBlock


def _packed(p: object) -> int | None:
    return p.data.data_ptr() if isinstance(p, PackedWeight) else None


def paged_rows(backend: AttentionBackend, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not isinstance(backend, TorchAttentionBackend):
        return None
    return backend.paged_rows(meta)
