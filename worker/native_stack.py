"""A model's decoder layers in one native call per step (worker/csrc/decoder_f32.c).

The C driver calls the same kernels as the layers' native CPU ops (worker/models/ops.py), in
the same order, on the same inputs, so its output is bit for bit theirs; what it removes is
the Python between them (wrappers, ctypes conversions, a tensor per result). It runs float32
activations on the CPU, one rank, packed GEMM weights (float32, bf16, or quantized: int8, int4 and
fp8 kinds through their descriptors, worker/gemm_quant_kernels.py), a float32, bf16,
float16 or fp8 KV cache (fp8 through its scaled entry point, with each layer's scales), and a
step whose attention is one call of the paged kernel per layer (decode rows, or
short prompts as rows: `TorchAttentionBackend.paged_rows`).
A mixture-of-experts layer runs its attention on the driver; its MLP is the layer's own
SparseMoeBlock, called back from the driver on the driver's normed rows.

What the driver runs is decided from the model's spec (its family's recipe, resolved) by
worker/native_coverage.py, once per set of KV caches; the layers it declines, with the
reason, run in Python between the driver's runs of the others, and the worker logs
`describe`'s line at start-up. worker/cpu_ops.py decides whether it is on
(NORIA_DISABLE_CPU_STACK=1: off).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from noria.worker import cpu_kernels, fused_kernels, gemm_bf16_kernels, gemm_kernels, native_layout
from noria.worker.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from noria.worker.cpu_ops import disabled
from noria.worker.models.linear import PackedHalfLinear, panels
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.native_build import build
from noria.worker.native_coverage import coverage, describe, segments
from noria.worker.native_layout import I64, Kernels, Layer, P, Shape, Step

if TYPE_CHECKING:
    from noria.worker.models.causal_lm import CausalLM
    from noria.worker.models.decoder import StepContext

__all__ = ["NativeStack", "coverage", "describe", "load", "paged_rows"]

_SRC = Path(__file__).parent / "csrc" / "decoder_f32.c"
# A sparse layer's MLP as the driver calls it: (layer index, rows) -> 0, or nonzero on failure.
_MOE_CALL = ctypes.CFUNCTYPE(ctypes.c_int, I64, I64)


def _gemm_half(layout: str) -> int | None:
    """The address of the bf16-weight GEMM over panels of `layout` (worker/csrc/gemm_bf16.c:
    gemm_f32's arguments), for a model whose linear kinds are bf16."""
    return ctypes.cast(gemm_bf16_kernels.entry(layout), P).value


@cache
def load() -> tuple[ctypes.CDLL, Kernels] | None:
    if disabled("stack"):
        return None
    gemm, fused, attn = gemm_kernels.load(), fused_kernels.load(), cpu_kernels.load()
    dll = build(_SRC, ["-O2", "-shared", "-fPIC"])
    if dll is None or gemm is None or fused is None or attn is None:
        return None
    native_layout.check(dll)
    dll.decoder_stack.argtypes = [P, P, I64, P, P, P, P]
    dll.decoder_stack.restype = ctypes.c_int

    def addr(fn: ctypes._CFuncPtr) -> int:
        return ctypes.cast(fn, P).value or 0

    kernels = Kernels(addr(gemm.gemm_f32), addr(fused.add_rms_norm), addr(fused.rope_split),
                      addr(fused.silu_mul), addr(attn.paged_decode_f32), addr(fused.qk_norm_rope_split),
                      addr(fused.rope_split_partial), addr(fused.gelu_tanh_mul),
                      addr(attn.paged_decode_capped_f32))
    return dll, kernels


class NativeStack:
    """One model's layers as the C driver sees them, for one set of KV caches.

    `segments` cuts the layers into runs, each all native or all Python (the layers
    `coverage` declines, with the reason why), in order."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 reasons: list[str | None]) -> None:
        spec, shapes = model.spec, model.shapes
        self.dims = (spec.hidden_size, shapes.num_heads, shapes.num_kv_heads, spec.head_dim, shapes.intermediate_size)
        self.shape = Shape(*self.dims, kv_caches[0][0].shape[1], spec.rms_norm_eps, spec.scale)
        self.segments = segments(reasons)
        # The driver's kernels, its GEMM the one the model's linear kind reads (coverage checked
        # every native layer has the kind of the first).
        loaded = load()
        assert loaded is not None
        self.kernels = Kernels.from_buffer_copy(loaded[1])
        # The attention kernel reads the caches' element type (coverage: one for every layer).
        attn, suffix = cpu_kernels.load(), cpu_kernels.CACHE_DTYPES[kv_caches[0][0].dtype]
        assert attn is not None
        if suffix == "fp8":  # the scaled entry, whose signature has each layer's scales
            self.kernels.attn_scaled = ctypes.cast(attn.paged_decode_capped_fp8, P).value
        else:
            self.kernels.attn = ctypes.cast(getattr(attn, f"paged_decode_{suffix}"), P).value
            self.kernels.attn_capped = ctypes.cast(getattr(attn, f"paged_decode_capped_{suffix}"), P).value
        first = model.layers[reasons.index(None)].self_attn.qkv_proj.op
        if isinstance(first, PackedHalfLinear):
            self.kernels.gemm = _gemm_half(first.packed.kind)
        elif getattr(first, "desc_ptr", None) is not None:  # quantized kinds: the entry that reads any descriptor
            from noria.worker import gemm_quant_kernels

            self.kernels.gemm = gemm_quant_kernels.entry("any")
        self.layer_runs = 0  # layers the driver ran, over this stack's life
        self._capacity, self._buffers = 0, []
        self._keep: list[torch.Tensor] = []  # biases the driver reads: contiguous copies, kept alive here
        # The sparse layers' blocks, the callback the driver calls them through, and while the
        # driver runs, its normed rows and output (`run`) and the failure of a block's call.
        self._moe_blocks: dict[int, SparseMoeBlock] = {}
        self._moe_call = _MOE_CALL(self._run_moe)
        self._io: tuple[torch.Tensor, torch.Tensor] | None = None
        self._moe_error: BaseException | None = None
        self.layers = (Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            if reasons[i] is not None:
                continue  # zeros: never passed to the driver
            at, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_caches[i]
            row = self.layers[i]
            row.qkv, row.qkv_bias = _packed(at.qkv_proj.op), self._bias(at.qkv_proj.bias)
            row.o, row.o_bias = _packed(at.o_proj.op), self._bias(at.o_proj.bias)
            row.input_norm, row.post_norm = _ptr(layer.input_layernorm.weight), _ptr(layer.mlp_norm.weight)
            row.k_cache, row.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            row.window = at.attn.sliding_window or 0
            if at.q_norm is not None and at.k_norm is not None:
                row.q_norm, row.k_norm = _ptr(at.q_norm.weight), _ptr(at.k_norm.weight)
            if layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None:
                row.post_attn_norm = _ptr(layer.post_attention_layernorm.weight)
                row.post_mlp_norm = _ptr(layer.post_feedforward_layernorm.weight)
            row.soft_cap = at.attn.logits_soft_cap or 0.0
            row.k_scale, row.v_scale = at.attn.k_scale, at.attn.v_scale
            row.geglu = int(spec.activation == "gelu_tanh")
            row.local_rope = int(at.local_rope)
            if isinstance(mlp, SparseMoeBlock):
                self._moe_blocks[i] = mlp
                row.moe = ctypes.cast(self._moe_call, P).value
                row.index = i
            else:
                row.gate_up, row.gate_up_bias = _packed(mlp.gate_up_proj.op), self._bias(mlp.gate_up_proj.bias)
                row.down, row.down_bias = _packed(mlp.down_proj.op), self._bias(mlp.down_proj.bias)

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

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
            rows: tuple[torch.Tensor, torch.Tensor], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers start..end-1 on the embedded tokens or the previous layer's output x [T, hidden]
        (contiguous; overwritten) and the residual stream (None before layer 0): (the last
        layer's output, the residual stream), as DecoderLayer.forward leaves them."""
        loaded = load()
        assert loaded is not None
        dll, kernels = loaded[0], self.kernels
        x = x.contiguous()
        hidden = self.dims[0]
        t = x.shape[0]
        tables, lens = (r.contiguous() for r in rows)
        slots = ctx.meta.slot_mapping.contiguous()
        cos, sin = ctx.cos.contiguous(), ctx.sin.contiguous()
        cos_local, sin_local = ctx.local_cos.contiguous(), ctx.local_sin.contiguous()
        buf = self._scratch(t)
        other = buf[-1][: t * hidden].view(t, hidden)
        if residual is not None and residual.data_ptr() != other.data_ptr():
            other.copy_(residual)  # the driver writes the new stream over it
        step = Step(t, tables.shape[1], cos.data_ptr(), sin.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                    slots.data_ptr(), *(b.data_ptr() for b in buf[:-1]), torch.get_num_threads(),
                    int(residual is not None), 2 * cos.shape[-1], cos_local.data_ptr(), sin_local.data_ptr())
        layers = ctypes.byref(self.layers, start * ctypes.sizeof(Layer))
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


def _packed(op: object) -> int | None:
    return panels(op)  # type: ignore[arg-type]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def paged_rows(backend: AttentionBackend, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not isinstance(backend, TorchAttentionBackend):
        return None
    return backend.paged_rows(meta)
