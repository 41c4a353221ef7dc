"""A decoder layer's ops, chosen once at load: the torch reference, the native CPU kernels, or
the CUDA kernels (on a GPU, or under the CPU emulator in tests).

Each kind computes the same steps: the residual add fused into the next RMSNorm, a norm on
its own (Gemma's post-norms), the gated activation, and attention from the fused QKV
projection (split, Qwen3's per-head q/k norm, rotary, cache write, attention). Whether a
layer can take a kernel depends only on facts fixed at load (device, dtype, the spec, the
layer's shapes, which kernels built), so `choose_ops` decides it once and the layers never
probe per call. The native CPU kinds compute exactly what the native decoder stack
(worker/native_stack.py) computes, so the two agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from noria.worker import fused_kernels
from noria.worker.models.layers import RMSNorm, act_and_mul, apply_rope

if TYPE_CHECKING:
    from noria.kernels.attention_backend import KernelAttentionBackend
    from noria.worker.models.decoder import Attention, StepContext

# (fused qkv [T, (H + 2 KVH) D], the step, the layer's cos, sin) -> attention output [T, H, D].
AttendFn = Callable[[torch.Tensor, "StepContext", torch.Tensor, torch.Tensor], torch.Tensor]


class TorchOps:
    """transformers' operators: the reference, and the path on any device and dtype."""

    name = "torch"

    def __init__(self, activation: str) -> None:
        self.activation = activation

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + h), residual + h), or (norm(h), h) without a residual."""
        if residual is not None:
            h = residual + h
        return norm(h), h

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return act_and_mul(gate_up, self.activation)

    def attention(self, layer: Attention) -> AttendFn:
        def attend(qkv: torch.Tensor, ctx: StepContext, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q, k, v = _split(layer, qkv)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            return _paged(layer, q, k, v.contiguous(), ctx)

        return attend


class CpuOps(TorchOps):
    """Float32 on the CPU with worker/csrc/fused_f32.c built: each step one pass instead of several
    torch operators; only the order of the RMSNorm's sum of squares differs from torch's."""

    name = "cpu"

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum is written into h, the layer's fresh output.
        return fused_kernels.add_rms_norm(h.contiguous(), residual, norm.weight, norm.eps)

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return fused_kernels.add_rms_norm(x.contiguous(), None, norm.weight, norm.eps)[0]

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return fused_kernels.silu_mul(gate_up)
        if self.activation == "gelu_tanh":
            return fused_kernels.gelu_tanh_mul(gate_up)
        return super().act_and_mul(gate_up)

    def attention(self, layer: Attention) -> AttendFn:
        a = layer.attn
        if layer.q_norm is None:
            def rope_split(qkv: torch.Tensor, ctx: StepContext, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                q, k, v = fused_kernels.rope_split(qkv, cos, sin, a.num_heads, a.num_kv_heads, a.head_dim)
                return _paged(layer, q, k, v, ctx)

            return rope_split
        q_norm, k_norm = layer.q_norm, layer.k_norm
        assert k_norm is not None
        if q_norm.eps == k_norm.eps and layer.rotary_dim == a.head_dim:  # the kernel rotates whole heads
            def qk_norm_rope_split(qkv: torch.Tensor, ctx: StepContext, cos: torch.Tensor,
                                   sin: torch.Tensor) -> torch.Tensor:
                q, k, v = fused_kernels.qk_norm_rope_split(qkv, cos, sin, a.num_heads, a.num_kv_heads, a.head_dim,
                                                           q_norm.weight, k_norm.weight, q_norm.eps)
                return _paged(layer, q, k, v, ctx)

            return qk_norm_rope_split
        return super().attention(layer)


class CudaOps:
    """The CUDA kernels (kernels.fused_ops and the kernel attention backend) where they take a
    layer, `base`'s ops elsewhere: a (1 + w) norm whose float32 weight is not the model's dtype,
    an activation with no kernel, a layer with a per-head q/k norm or shapes the attention
    kernels were not built for (`KernelAttentionBackend.unsupported`)."""

    name = "cuda"

    def __init__(self, base: TorchOps, attention: KernelAttentionBackend, dtype: torch.dtype,
                 block_size: int) -> None:
        self.base, self.kernels = base, attention
        self.dtype, self.block_size = dtype, block_size
        from noria.kernels.ops import DTYPE_NAMES

        self.fuses = dtype in DTYPE_NAMES  # the fused elementwise kernels' dtypes

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuses and norm.weight.dtype == self.dtype:
            from noria.kernels import fused_ops

            out = fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps, backend=self.kernels.backend)
            return out, (h if residual is None else residual)
        return self.base.add_norm(h, residual, norm)

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self.base.norm(x, norm)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fuses and self.base.activation == "silu":
            from noria.kernels import fused_ops

            return fused_ops.silu_and_mul(gate_up, backend=self.kernels.backend)
        return self.base.act_and_mul(gate_up)

    def attention(self, layer: Attention) -> AttendFn:
        if layer.q_norm is not None or self.kernels.unsupported(layer.attn, self.dtype, self.block_size) is not None:
            return self.base.attention(layer)
        kernels = self.kernels

        def rotary_attention(qkv: torch.Tensor, ctx: StepContext, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            # Rotary on q and k in place with the cache write in one kernel, then the attention kernel.
            k_cache, v_cache = ctx.kv_caches[layer.layer_index]
            return kernels.rotary_attention(layer.attn, qkv, cos, sin, k_cache, v_cache, ctx.meta)

        return rotary_attention


Ops = TorchOps | CudaOps


def choose_ops(activation: str, device: torch.device, dtype: torch.dtype, attention: Any = None,
               block_size: int = 16) -> Ops:
    """The ops of a model on `device` in `dtype`; `attention` is the worker's attention backend
    (the kernel one brings the CUDA ops)."""
    cpu = device.type == "cpu" and dtype == torch.float32 and fused_kernels.load() is not None
    base = CpuOps(activation) if cpu else TorchOps(activation)
    from noria.worker.attention_select import kernel_attention

    kernels = kernel_attention(attention)
    return CudaOps(base, kernels, dtype, block_size) if kernels is not None else base


def _split(layer: Attention, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, a = qkv.shape[0], layer.attn
    q, k, v = qkv.split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
    return (q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim),
            v.view(t, a.num_kv_heads, a.head_dim))


def _paged(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    k_cache, v_cache = ctx.kv_caches[layer.layer_index]
    return ctx.backend.forward(layer.attn, q, k, v, k_cache, v_cache, ctx.meta)
