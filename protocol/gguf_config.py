"""What a GGUF file's metadata says about its model that transformers' config reading drops, as
llama.cpp reads it, folded into the config.json of the file's folder view (frontend/gguf_view.py).

transformers maps a fixed list of keys per architecture (its `integrations.ggml` module); llama.cpp also
applies, and noria with it:
* `rope_freqs.weight`, Llama 3.1's rope scaling as one factor per rotary frequency (the converter
  computes them from rope_scaling's llama3 parameters): the parameters are recovered from the
  factors and checked to give them back, else the file is refused;
* `<arch>.rope.scaling.type` / `.factor` / `.original_context_length`: linear and YaRN scaling
  (Gemma 3's on its global layers only: its sliding layers keep their own base);
* Gemma 2's soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`);
* Gemma's attention scale, which GGUF does not store: 1 / sqrt(head_dim), or 1 / sqrt(hidden /
  heads) for the 27B models, recognised by their layer count (llama.cpp's rule).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from noria.protocol import gguf_file

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def metadata_config(reader: Any, arch: str, cfg: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`cfg` (transformers' config of the file, as a dict) with what the metadata says beside it;
    GGUFError (one sentence) where the file asks for something noria cannot reproduce."""
    cfg = dict(cfg)
    key = f"{arch}."
    if arch in _GEMMA_27B_LAYERS:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = gguf_file.field(reader, key + name)
            if value is not None:
                cfg[name] = float(value) or None
        big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                        else _head_dim(cfg))
    scaling = _rope_scaling(reader, key, path)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if scaling:
            raise gguf_file.GGUFError(f"{path} has both rope_freqs and {arch}.rope.scaling.type "
                                      f"{scaling['rope_type']}; noria cannot apply the two together")
        scaling = _llama3_from_factors(freqs, cfg, path)
    if scaling:
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # Gemma 3: the global layers' rope only
            rope = {**rope, "full_attention": {**rope["full_attention"], **scaling}}
        else:
            rope = {**rope, **scaling}
        cfg["rope_parameters"] = rope
    return cfg


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _rope_scaling(reader: Any, key: str, path: str | Path) -> dict[str, Any]:
    kind = gguf_file.field(reader, key + "rope.scaling.type")
    factor = gguf_file.field(reader, key + "rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = gguf_file.field(reader, key + "rope.scaling.original_context_length")
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        for name in ("beta_fast", "beta_slow"):
            value = gguf_file.field(reader, f"{key}rope.scaling.yarn_{name}")
            if value is not None:
                out[name] = float(value)
        # llama.cpp's other YaRN knobs change cos / sin in ways transformers' yarn has no key for.
        for name, neutral in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            value = gguf_file.field(reader, f"{key}rope.scaling.{name}")
            if value is not None and float(value) != neutral:
                raise gguf_file.GGUFError(f"{path} sets {key}rope.scaling.{name} = {value}, which noria does not "
                                          "apply")
        return out
    raise gguf_file.GGUFError(f"{path} asks for rope scaling {kind!r} (factor {factor}), which noria does not "
                              "apply from a GGUF file (supported: linear, yarn, Llama 3's rope_freqs)")


def llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """The factor llama.cpp's converter writes into rope_freqs for each inverse frequency."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _llama3_from_factors(tensor: Any, cfg: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """Llama 3's rope parameters that give the file's rope_freqs back (every Llama 3.x release has
    low 1, high 4, original context 8192; others are fitted: in the blended band 1 / factor is
    linear in 1 / wavelength, which fixes the band with low_freq_factor taken as 1)."""
    refuse = f"{path}: its rope_freqs tensor (per-frequency rope factors) does not follow Llama 3's rope scaling"
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise gguf_file.GGUFError(f"{refuse}: it is of type {tensor.tensor_type.name}")
    ff = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    dim = _head_dim(cfg)
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if 2 * ff.size != dim:
        raise gguf_file.GGUFError(f"{refuse}: it has {ff.size} factors for a head of {dim} dims")
    if np.all(ff == 1.0):
        return {}
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    factor = float(ff.max())
    candidates = [(1.0, 4.0, 8192.0)]
    middle = (ff > 1 + 1e-6) & (ff < factor * (1 - 1e-6))
    if factor > 1 and middle.sum() >= 2:
        smooth = (1 / ff[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv[middle] / (2 * math.pi), smooth, 1)
        if intercept < 0 < slope:
            width = -1 / intercept
            candidates.append((1.0, 1.0 + width, float(round(slope * width))))
    for low, high, original in candidates:
        if np.allclose(llama3_factors(inv, factor, low, high, original), ff, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(original)}
    raise gguf_file.GGUFError(f"{refuse}; noria does not apply arbitrary per-frequency factors")
