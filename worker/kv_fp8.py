"""The fp8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3, vLLM's flag and format).

Each cached value is one byte, torch.float8_e4m3fn, with one scale per layer for K and one for V:
stored = fp8(k / k_scale), read = fp8 * k_scale, as vLLM stores it. A write divides (a true
division, as vLLM's `a / scale`), saturates to +-448 (vLLM's cache writes convert with
__NV_SATFINITE: a finite value past the largest e4m3 becomes it, NaN stays NaN) and rounds to
nearest even; a read widens exactly and multiplies by the scale. The native CPU kernel
(worker/csrc/paged_decode.c) writes and reads the same bits.

Scales come from the checkpoint where it has them, under the names vLLM's loader maps onto its
attention layers (`maybe_remap_kv_scale_name`, compressed-tensors' `get_cache_scale`):
`self_attn.k_scale` / `v_scale`, ModelOpt's `self_attn.k_proj.k_scale` / `v_proj.v_scale`,
compressed-tensors' `self_attn.k_proj.output_scale` / `v_proj.output_scale`, and the deprecated
single `self_attn.kv_scale`, used for both. As vLLM's BaseKVCacheMethod: both present, each its
own; one, it serves K and V; none, 1.0. They are read whatever --kv-cache-dtype says (a
checkpoint that carries them loads either way) and used only by an fp8 cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from noria.worker.models.decoder import Attention
    from noria.worker.models.weights import WeightMap

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
NAME = "fp8_e4m3"

# Checkpoint tensor (after "layers.N.self_attn.") -> which scale it is.
_CHECKPOINT_NAMES = {"k_scale": "k", "v_scale": "v", "k_proj.k_scale": "k", "v_proj.v_scale": "v",
                     "k_proj.output_scale": "k", "v_proj.output_scale": "v", "kv_scale": "kv"}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `choice`: fp8 (= fp8_e4m3), else the model's."""
    return FP8 if choice in ("fp8", "fp8_e4m3") else model_dtype


def describe(dtype: torch.dtype) -> str:
    """The cache's dtype as the start-up line names it."""
    if is_fp8(dtype):
        return f"{NAME} (fp8, 1 byte per value, scaled per layer)"
    return f"{str(dtype).removeprefix('torch.')} ({torch.empty((), dtype=dtype).element_size()} bytes per value)"


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache stores for the values x: fp8(x / scale), divided in float32, saturated to
    +-448, rounded to nearest even."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


# Every byte's float32, exact (NaN for S.1111.111): dequantize's table on the CPU.
_WIDE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 cache's bytes x read as, in `dtype`: widened to float32 (exact), times the scale."""
    if x.device.type != "cpu":
        return (x.float() * scale).to(dtype)
    # torch widens fp8 one element at a time on the CPU (~3.4 ns each: 5 ms for a 2,048-token
    # layer's K); looking each byte up in the 256 products of the same expression gives the same
    # values 5x faster (the torch backend's prefill over an fp8 cache reads every cached row so).
    table = (_WIDE * scale).to(dtype)
    return table.index_select(0, x.view(torch.uint8).reshape(-1).int()).view(x.shape)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the tensor its rows move in: fp8 as uint8 (torch has no index_copy_ for fp8)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


@dataclasses.dataclass
class CheckpointScales:
    """An attention layer's K/V cache scales as its checkpoint gave them (None: not given)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    kv: torch.Tensor | None = None  # the deprecated single scale

    def resolve(self, layer: str) -> tuple[float, float] | None:
        """(k_scale, v_scale) by vLLM's rules, or None where the checkpoint has none. ValueError
        (one sentence) for a scale that is not one positive finite number."""
        values = {w: _one(t, f"{layer}.{w}_scale") for w, t in (("k", self.k), ("v", self.v), ("kv", self.kv))
                  if t is not None}
        if "k" in values and "v" in values:
            return values["k"], values["v"]
        if not values:
            return None
        one = max(values.values())  # a single scale (kv_scale, or k or v alone) serves both
        return one, one


def _one(t: torch.Tensor, what: str) -> float:
    if t.numel() != 1:
        raise ValueError(f"checkpoint tensor {what} holds {t.numel()} values: the fp8 KV cache takes one "
                         "scale per layer for K and one for V (per-tensor)")
    value = float(t.float().item())
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"checkpoint tensor {what} is {value}: a KV cache scale must be positive and finite")
    return value


def register_scales(wm: WeightMap, prefix: str, scales: CheckpointScales) -> None:
    """Loaders for a layer's scale tensors under every name vLLM reads them by (`prefix`:
    "layers.N.self_attn.")."""
    for suffix, which in _CHECKPOINT_NAMES.items():
        def keep(tensor: torch.Tensor, what: str, which: str = which) -> None:
            setattr(scales, which, tensor.detach().to("cpu", copy=True))

        wm.add(prefix + suffix, keep)


def apply_scales(layers: Iterable[Attention], dtype: torch.dtype) -> str | None:
    """Give every attention layer its scales where the cache is fp8 (LayerAttention.k_scale and
    v_scale, which the attention backends read); the start-up line saying where they came from,
    or None for another cache dtype."""
    if not is_fp8(dtype):
        return None
    layers = list(layers)
    found = 0
    for layer in layers:
        scales = layer.kv_scales.resolve(f"layers.{layer.layer_index}.self_attn")
        if scales is not None:
            found += 1
            layer.attn = dataclasses.replace(layer.attn, k_scale=scales[0], v_scale=scales[1])
    if found:
        return f"KV cache {NAME}: k/v scales from the checkpoint for {found} of {len(layers)} layers (else 1.0)"
    # vLLM warns the same: values past +-448 saturate and small ones lose precision.
    return (f"KV cache {NAME}: the checkpoint has no k_scale / v_scale, so every scale is 1.0 (values past "
            f"+-{FP8_MAX:g} saturate; this may cost accuracy)")
