"""Rotary embedding numbers for every rope type a checkpoint may name, computed once at load.

`rope_frequencies` turns a `RopeSpec` into the inverse frequencies of the rotated dims and
the attention factor that scales cos and sin (yarn's mscale, longrope's scaling factor).
`RotaryEmbedding` (worker/models/layers.py) multiplies them by each step's positions; the
resulting cos/sin rows [T, rotary_dim / 2] are the one table every rotary path reads: torch's
`apply_rope`, the CPU's fused kernel and native stack, and the CUDA fused kernel. None of
them knows the rope type.

Float32 arithmetic follows transformers' `ROPE_INIT_FUNCTIONS` operator for operator, so
greedy output matches it token for token. Where vLLM and transformers part, noria does as
vLLM does, fixed at start-up:

* `dynamic` (NTK): transformers keeps the plain frequencies up to max_position_embeddings
  and rescales the base on every forward pass whose sequence is longer, from that
  sequence's length (and back again for a shorter one). vLLM, and noria, use one base
  for every position: the NTK base for max_position_embeddings * factor positions. The
  two agree where transformers' sequence is max_position_embeddings * factor long.
* `longrope` (Phi-3): transformers picks the short or long factors per forward pass by
  the current sequence length (long beyond original_max_position_embeddings). vLLM, and
  noria, pick once by the engine's context length (--max-model-len, else
  max_position_embeddings): long factors when it exceeds original_max_position_embeddings.
  The two agree for every sequence when the context length is at most the original one,
  and for sequences longer than the original one otherwise.
"""

from __future__ import annotations

import math

import torch

from noria.protocol.rope_config import RopeSpec


def rotary_dim(rope: RopeSpec, head_dim: int) -> int:
    """How many leading dims of each head rotate (all of them unless partial_rotary_factor < 1)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor {rope.partial_rotary_factor} of head_dim {head_dim} rotates "
                         f"{dim} dims; rotary needs an even number of at least 2")
    return dim


def uses_long_factors(rope: RopeSpec) -> bool:
    """longrope: whether the context length the engine serves exceeds the pretraining one."""
    context = rope.max_model_len or rope.max_position_embeddings
    return context > rope.original_max_position_embeddings


def rope_frequencies(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, attention factor) for `rope`."""
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind = rope.rope_type
    if kind in ("default", "linear", "llama3"):
        inv_freq = 1.0 / (rope.theta**exponents)
        if kind == "linear":
            inv_freq = inv_freq / rope.factor
        elif kind == "llama3":
            inv_freq = _llama3_scale(inv_freq, rope)
        return inv_freq, 1.0
    if kind == "dynamic":
        # The NTK base transformers computes for a sequence of max_position * factor tokens.
        seq_len = rope.max_position_embeddings * rope.factor
        base = rope.theta * ((rope.factor * seq_len / rope.max_position_embeddings) - (rope.factor - 1)) ** (
            dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "yarn":
        return _yarn(rope, dim), _yarn_attention_factor(rope)
    if kind == "longrope":
        factors = rope.long_factor if uses_long_factors(rope) else rope.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"longrope has {len(factors)} factors for {dim // 2} rotary frequencies")
        ext = torch.tensor(factors, dtype=torch.float32)
        return 1.0 / (ext * rope.theta**exponents), _longrope_attention_factor(rope)
    raise ValueError(f"unsupported rope type {kind!r}")


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rope: RopeSpec) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return float(_yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim))
    return _yarn_mscale(rope.factor)


def _yarn(rope: RopeSpec, dim: int) -> torch.Tensor:
    # YaRN: dims that turn many times over the pretraining length keep their frequency
    # (extrapolate), dims that turn less than once are slowed by `factor` (interpolate),
    # with a linear ramp between the two correction dims.
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope_attention_factor(rope: RopeSpec) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
