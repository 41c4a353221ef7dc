"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SwiGLU, linear."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import fused_kernels, gemm_kernels
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.models.rope import rope_frequencies
from noria.worker.models.spec import RopeSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers (normalize in float32, cast back, then
        # scale) so float32 greedy output matches token for token.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, h: torch.Tensor, residual: torch.Tensor | None,
                    fused: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + h), residual + h), or (self(h), h) without a residual.

        `h` is a layer's fresh output: the CPU's fused kernel writes the sum into it;
        `fused` (the kernel attention backend, GPU path) writes it into `residual`.
        Either kernel is one pass instead of six operators; only the order of the
        sum of squares differs from torch's."""
        if fused is not None and h.dim() == 2 and fused.fuses(h) and self.weight.dtype == h.dtype:
            return fused.add_rms_norm(h, residual, self.weight, self.eps)
        if fused_kernels.usable(h) and h.is_contiguous() and h.dim() == 2:
            return fused_kernels.add_rms_norm(h, residual, self.weight, self.eps)
        if residual is not None:
            h = residual + h
        return self(h), h


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotated dims, with the checkpoint's scaling applied."""
    return rope_frequencies(rope, head_dim)[0]


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), cos/sin computed per position each step.

    Computing from positions (T x rotary_dim/2 multiplies) is cheaper than keeping
    a max_position-long table and gives bit-identical values to transformers. The
    rope type lives in `inv_freq` and `attention_factor` (worker/models/rope.py),
    both fixed at load; every rotary path reads the same cos/sin rows.
    """

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(rope, head_dim)
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # scaled in float32 before the cast, as transformers does
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # [T, 1, rotary_dim/2]: broadcasts over heads.
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, rotary_dim/2]. Dims past rotary_dim pass through."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def silu_and_mul(gate_up: torch.Tensor, fused: Any = None) -> torch.Tensor:
    """`fused`: the kernel attention backend, whose kernel runs it on the GPU path."""
    if fused is not None and gate_up.dim() == 2 and fused.fuses(gate_up):
        return fused.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fused_kernels.usable(gate_up):
        return fused_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The native GEMM's pre-packed copy of a [out, in] weight, or None where F.linear serves.

    Packed for float32 on the CPU while worker/cpu_ops.py has the gemm family native:
    against oneDNN's packed weights (torch's private mkldnn ops, which noria does not use) it
    is 1.05-1.7x faster per call at 1-512 rows on the "small" model's shapes, and it keeps
    no state per row count. The plain weight stays: it serves everything off the CPU.
    """
    if gemm_kernels.usable(weight):
        return PackedWeight(weight)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x @ weight.T + bias for 2-D x: the native GEMM through `packed`, else F.linear."""
    if packed is not None and x.dtype == torch.float32:
        return gemm_kernels.gemm(x, packed, bias)
    return F.linear(x, weight, bias)
