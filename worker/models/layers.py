"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SwiGLU, linear."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import fused_kernels, gemm_kernels
from noria.worker.gemm_kernels import PackedWeight
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

    def add_forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + h), residual + h), or (self(h), h) without a residual.

        `h` is a layer's fresh output: the fused kernel writes the sum into it.
        The kernel is one pass instead of six operators; only the order of the
        sum of squares differs from torch's."""
        if fused_kernels.usable(h) and h.is_contiguous() and h.dim() == 2:
            return fused_kernels.add_rms_norm(h, residual, self.weight, self.eps)
        if residual is not None:
            h = residual + h
        return self(h), h


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for `head_dim`, with the checkpoint's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band in between is blended linearly in 1/wavelength.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), cos/sin computed per position each step.

    Computing from positions (T x head_dim/2 multiplies) is cheaper than keeping
    a max_position-long table and gives bit-identical values to transformers.
    """

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        # [T, 1, head_dim/2]: broadcasts over heads.
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fused_kernels.usable(gate_up):
        return fused_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Below this many rows torch's gemv-like path beats oneDNN's blocked kernel
# (measured on the "small" model's shapes); from here up the packed weight wins
# by 1.3-2x, most in the 4-64 row decode batches that dominate real traffic.
# (These apply to the oneDNN fallback only, where the native GEMM is unavailable.)
PACKED_MIN_ROWS = 4
# oneDNN (and ideep above it) cache one primitive per row count, about 0.4 MiB
# each, up to 1024 entries per cache: fed every row count a server meets, a
# worker's RSS grew by a GiB. So up to 64 rows (decode) each count is its own
# primitive; to 256 rows the rows are padded up to a multiple of 16 (at most 15
# wasted rows, still ~1.5x faster than unpacked); above 256 rows (prefill
# chunks) the packed weight gains under 5 %, and plain F.linear, which caches
# nothing, serves. That leaves 73 row counts per weight shape.
PACKED_EXACT_ROWS = 64
PACKED_MAX_ROWS = 256
PACKED_ROW_STEP = 16

# A pre-packed weight: the native kernel's panels (worker/csrc/gemm_f32.c), or
# oneDNN's blocked tensor where no C compiler is at hand.
Packed = PackedWeight | torch.Tensor


def packed_rows(rows: int) -> int | None:
    """The row count a batch of `rows` is computed with on oneDNN's packed path, or None (unpacked)."""
    if rows < PACKED_MIN_ROWS or rows > PACKED_MAX_ROWS:
        return None
    return rows if rows <= PACKED_EXACT_ROWS else -(-rows // PACKED_ROW_STEP) * PACKED_ROW_STEP


def pack_linear_weight(weight: torch.Tensor, native: bool = True) -> Packed | None:
    """A pre-packed copy of a [out, in] weight for the CPU, or None where none applies.

    The native GEMM first: against oneDNN's packed path it was 1.05-1.7x faster
    per call at 1-512 rows on the "small" model's shapes (one AVX2 core), keeps
    no state per row count, and needs no padding. oneDNN's copy (`native=False`,
    or no C compiler) re-blocks nothing per call either. The plain weight stays:
    it serves everything off the CPU and oneDNN's unpacked row counts.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if native and gemm_kernels.usable(weight):
        return PackedWeight(weight)
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: Packed | None) -> torch.Tensor:
    """x @ weight.T + bias for 2-D x, through `packed` where it applies."""
    if isinstance(packed, PackedWeight) and x.dtype == torch.float32:
        return gemm_kernels.gemm(x, packed, bias)
    rows = x.shape[0]
    padded = None if packed is None else packed_rows(rows)
    if padded is None or isinstance(packed, PackedWeight):
        return F.linear(x, weight, bias)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
