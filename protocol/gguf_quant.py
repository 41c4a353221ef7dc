"""GGUF tensor types as the worker's weight schemes (protocol/quant_config.py), torch-free.

A GGUF file's `quantization_config` (written into its cached folder view, frontend/gguf_view.py)
names each linear module's GGUF tensor and type. Each supported block type becomes the integer
values, float32 scales (and minimums) a QuantLinear holds, exactly: every product below is of an
f16 and an integer of at most 8 bits, which float32 holds without rounding.

  Q8_0  values q in [-128, 127], 32 per f16 scale d                    w = d * q
  Q4_0  values q - 8 in [-8, 7], 32 per d                              w = d * (q - 8)
  Q6_K  values q - 32 in [-32, 31] (8-bit container), 16 per d * sc    w = (d * sc) * q
  Q4_K  values q in [0, 15], 32 per d * sc and per minimum dmin * m    w = (d * sc) * q - dmin * m
  Q4_1  values q in [0, 15], 32 per d and per minimum -m                w = d * q - (-m)
  Q5_0  values q - 16 in [-16, 15] (8-bit container), 32 per d          w = d * (q - 16)
  Q5_1  values q in [0, 31] (8-bit container), 32 per d and per -m      w = d * q - (-m)
  Q5_K  values q in [0, 31] (8-bit container), as Q4_K otherwise        w = (d * sc) * q - dmin * m
  Q3_K  values q in [-4, 3], 16 per d * (sc - 32)                       w = (d * (sc - 32)) * q
  Q2_K  values q in [0, 3], 16 per d * sc and per minimum dmin * m      w = (d * sc) * q - dmin * m
  IQ4_NL values from a fixed table of 16 in [-127, 113] (8-bit), 32 per d   w = d * table[q]

llama-quantize writes the middle ones into K-quant files too: a tensor whose rows are not a
multiple of 256 falls back from Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, Q2_K / Q3_K to IQ4_NL.

A layer that fuses checkpoint modules (q/k/v, gate/up) computes them with one scheme; where a file
gives them different types (Q4_K_M stores some attn_v and ffn_down in Q6_K beside Q4_K), the parts
share the narrowest group of their types, 8-bit containers and a minimum where any has one (zero
for the others), which holds every part's values and products unchanged; 4-bit containers where
every part is 4-bit and all or none have minimums (values in [0, 15], or [-8, 7], for them all). A part kept in float
makes the fused layer float (its other parts dequantized at load, as the reference does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from noria.protocol.quant_config import QuantSpec, WeightScheme

FLOAT_TYPES = ("F32", "F16", "BF16")
SCHEMES: dict[str, WeightScheme] = {
    "Q8_0": WeightScheme(8, 32, True, packed=False, act_int8=False),
    "Q4_0": WeightScheme(4, 32, True, packed=False, act_int8=False),
    "Q6_K": WeightScheme(8, 16, True, packed=False, act_int8=False),
    "Q4_K": WeightScheme(4, 32, True, packed=False, act_int8=False, minimum=True),
    "Q4_1": WeightScheme(4, 32, True, packed=False, act_int8=False, minimum=True),
    "Q5_0": WeightScheme(8, 32, True, packed=False, act_int8=False),
    "Q5_1": WeightScheme(8, 32, True, packed=False, act_int8=False, minimum=True),
    "Q5_K": WeightScheme(8, 32, True, packed=False, act_int8=False, minimum=True),
    "Q3_K": WeightScheme(4, 16, True, packed=False, act_int8=False),
    "Q2_K": WeightScheme(4, 16, True, packed=False, act_int8=False, minimum=True),
    "IQ4_NL": WeightScheme(8, 32, True, packed=False, act_int8=False),
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *SCHEMES)
# The checkpoint modules one layer of the worker fuses (worker/models/decoder.py).
_FUSED = (("self_attn.", ("q_proj", "k_proj", "v_proj")), ("mlp.", ("gate_proj", "up_proj")))


def gguf_quant(q: Mapping[str, Any]) -> QuantSpec:
    """The QuantSpec of a GGUF view's quantization_config; ValueError names the first tensor of a
    type noria does not compute."""
    types = q.get("tensor_types")
    if not isinstance(types, Mapping) or not isinstance(q.get("gguf_file"), str):
        raise ValueError("a gguf quantization_config needs gguf_file and tensor_types")
    schemes: dict[str, WeightScheme | None] = {}
    for module, (tensor, kind) in types.items():
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor} ({module}) is of type {kind}, which noria does not compute "
                             f"yet (supported: {', '.join(SUPPORTED_TYPES)})")
        schemes[module] = SCHEMES.get(kind)
    for group in _fused_groups(schemes):
        merged = merge([schemes[m] for m in group])
        schemes.update(dict.fromkeys(group, merged))
    counts: dict[str, int] = {}
    for _, kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    label = ", ".join(f"{k} x {n}" for k, n in sorted(counts.items()))
    groups = tuple(((m,), s) for m, s in schemes.items() if s is not None)
    return QuantSpec(method="gguf", groups=groups, label=label)


def _fused_groups(modules: Mapping[str, Any]) -> list[list[str]]:
    out = []
    for prefix in sorted({m.rsplit(".", 2)[0] for m in modules if m.count(".") >= 2}):
        for block, parts in _FUSED:
            group = [f"{prefix}.{block}{p}" for p in parts]
            if all(g in modules for g in group):
                out.append(group)
    return out


def merge(schemes: list[WeightScheme | None]) -> WeightScheme | None:
    """One scheme that holds every part's values exactly (module docstring); None if any is float."""
    if any(s is None for s in schemes):
        return None
    first = schemes[0]
    assert first is not None
    if all(s == first for s in schemes):
        return first
    parts = [s for s in schemes if s is not None]
    group = math.gcd(*(s.group for s in parts if s.group is not None))
    minimum = {s.minimum for s in parts}
    bits = 4 if all(s.bits == 4 for s in parts) and len(minimum) == 1 else 8
    return WeightScheme(bits, group, True, packed=False, act_int8=False, minimum=True in minimum)
