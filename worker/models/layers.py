"""The torch reference of a decoder layer's elementwise pieces: RMSNorm, rotary, gated activations.

These follow transformers' operator order, so float32 greedy output matches it token for
token; worker/models/ops.py decides once at load whether a layer runs them or a native or
CUDA kernel that computes the same step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from noria.protocol.rope_config import RopeSpec
from noria.worker.models.rope import rope_frequencies


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm (normalize in float32, cast back, then scale), or with
    `one_plus` Gemma's: x / rms(x) * (1 + w) all in float32, cast back once. A (1 + w) norm keeps
    its weight in float32 holding 1 + w (the loader adds the 1), so in a float32 model both
    kinds are one kernel: weight * normalized."""

    def __init__(self, size: int, eps: float, one_plus: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if one_plus else None
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)


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


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for [..., 2 I] rows (gate first): activation "silu", "gelu_tanh" or "gelu"."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up
