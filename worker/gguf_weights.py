"""A GGUF file's tensors, under transformers' names, in the forms the model's loaders take.

The file is memory-mapped (protocol/gguf_file.py) and read one tensor at a time:
* a linear module the spec quantizes (protocol/gguf_quant.py): its blocks decoded
  (worker/gguf_blocks.py) into "<module>.weight" (int8 values), ".weight_scale" and, for a scheme
  with minimums, ".weight_min", widened to the scheme of the layer it is fused into where that
  differs (a narrower group repeats the scales; a missing minimum is zero), never to float;
* everything else in float32: float tensors as stored, quantized ones dequantized by the gguf
  package, as transformers' loader does. That is the embedding table (a lookup, not a GEMM: only
  the looked-up rows are read per step, so its bytes do not bound decode; tied models' lm_head
  reads it too), the norms (F32 in every llama.cpp file), and a fused layer's parts where one
  part is kept in float.
Llama's q/k rows are un-permuted and Gemma's norms lose their stored 1 exactly as transformers'
loader does (protocol/gguf_file.py), so the weights are the ones the reference computes with.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from noria.protocol import gguf_file
from noria.protocol.gguf_quant import FLOAT_TYPES
from noria.protocol.model_spec import ModelSpec, read_config
from noria.protocol.quant_config import WeightScheme
from noria.worker.gguf_blocks import DECODERS


def gguf_path(folder: str | Path) -> str:
    """The GGUF file a folder view stands for (its config.json's quantization_config)."""
    return str(read_config(folder)["quantization_config"]["gguf_file"])


def iter_gguf_weights(folder: str | Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    path = gguf_path(folder)
    reader = gguf_file.open_gguf(path)
    arch = gguf_file.architecture(reader, path)
    quant = spec.quantization
    for t in reader.tensors:
        name = gguf_file.hf_name(t.name, arch)
        if name is None:
            if t.name in gguf_file.IGNORED:
                continue
            raise ValueError(f"{path}: GGUF tensor {t.name} has no place in a {spec.architecture}")
        module, suffix = name.rsplit(".", 1)
        scheme = quant.scheme_for(module) if quant is not None and suffix == "weight" else None
        rows = gguf_file.shape(t)[0]
        heads = _heads(t.name, arch, spec)
        if scheme is None or t.tensor_type.name in FLOAT_TYPES:
            w = _float(t)
            if gguf_file.norm_minus_one(t.name, arch):
                w = w - 1
            yield name, torch.from_numpy(_unpermute(w, heads))
            continue
        kind = t.tensor_type.name
        values, scales, mins = DECODERS[kind](np.asarray(t.data), rows)
        if not (np.isfinite(scales).all() and (mins is None or np.isfinite(mins).all())):
            # An inf or NaN f16 scale would turn every output it touches into NaN, silently.
            raise ValueError(f"{path}: GGUF tensor {t.name} ({kind}) has a scale or minimum that is not finite")
        values, scales, mins = _widen(values, scales, mins, scheme, kind)
        yield name, torch.from_numpy(_unpermute(values, heads))
        yield f"{name}_scale", torch.from_numpy(_unpermute(scales, heads))
        if mins is not None:
            yield f"{name}_min", torch.from_numpy(_unpermute(mins, heads))


def _float(t: object) -> np.ndarray:
    from gguf.quants import dequantize

    w = dequantize(np.asarray(t.data), t.tensor_type)  # type: ignore[attr-defined]
    return np.array(w, dtype=np.float32).reshape(gguf_file.shape(t))  # a copy: the map is read-only


def _widen(values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, scheme: WeightScheme,
           kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The decoded tensor in the scheme of the layer it loads into (protocol/gguf_quant.merge)."""
    group = values.shape[1] // scales.shape[1]
    target = scheme.group or values.shape[1]
    if group % target:
        raise ValueError(f"GGUF {kind} groups of {group} cannot load into groups of {target}")
    if group != target:
        scales = np.repeat(scales, group // target, axis=1)
        mins = None if mins is None else np.repeat(mins, group // target, axis=1)
    if scheme.minimum and mins is None:
        mins = np.zeros_like(scales)
    elif mins is not None and not scheme.minimum:
        raise ValueError(f"GGUF {kind} has minimums but the layer's scheme {scheme.name} does not")
    return values, scales, mins


def _heads(name: str, arch: str, spec: ModelSpec) -> int | None:
    if not gguf_file.permuted_rows(name, arch):
        return None
    return spec.num_heads if ".attn_q." in name else spec.num_kv_heads


def _unpermute(w: np.ndarray, heads: int | None) -> np.ndarray:
    """llama.cpp's q/k row permutation undone (transformers' LlamaTensorProcessor): each head's
    rows, stored as [half, pair] -> [pair, half]. It moves whole rows, so it applies alike to
    values, scales and minimums."""
    if heads is None:
        return np.ascontiguousarray(w)
    dim = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape))
