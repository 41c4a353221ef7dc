"""AWQ and GPTQ `quantization_config`s, read as vLLM reads them, into a QuantSpec (torch-free).

AWQ (AutoAWQ's GEMM layout): 4-bit values q in [0, 15] with an integer zero point z and an f16
scale s per group of input features, w = (q - z) * s; qweight is int32 [K, N/8] and qzeros int32
[K/G, N/8], eight values per word along the output features in the interleaved order
0, 2, 4, 6, 1, 3, 5, 7; scales [K/G, N].

GPTQ (AutoGPTQ, GPTQModel): 4- or 8-bit values packed along the input features, qweight int32
[K * bits / 32, N]; zero points packed along the output features, qzeros int32 [G, N * bits / 32],
stored as z - 1 by the "gptq" (v1) checkpoint format and as z by "gptq_v2"; scales [G, N]; g_idx
int32 [K], each input feature's group. With desc_act the groups follow activation order, so g_idx
is a permutation of the groups' members rather than k // G; the worker sorts the input features
by it (worker/models/quant_awq_gptq.py). A symmetric scheme's zero points are the constant 2^(b-1).

What a config asks beyond this (AWQ's GEMV, Marlin and ExLlama layouts, GPTQ's 2- and 3-bit
values, per-module `dynamic` overrides, a quantized lm_head, other checkpoint formats) is refused
in one sentence before a weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from noria.protocol.quant_config import QuantSpec, WeightScheme

AWQ_SUPPORTED = "AWQ in AutoAWQ's GEMM layout (4-bit, zero points, a group size or per channel)"
GPTQ_SUPPORTED = ("GPTQ (4 or 8 bits, a group size or per channel, desc_act false or true, "
                  "checkpoint_format gptq or gptq_v2)")
LAYOUTS = ("awq", "gptq", "gptq_v2")


def awq_gptq_quant(q: Mapping[str, Any]) -> QuantSpec:
    """The QuantSpec of an "awq" or "gptq" quantization_config; ValueError names what is not computed."""
    return _awq(q) if q.get("quant_method") == "awq" else _gptq(q)


def _first(q: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    # Several writers name the same setting differently (AutoAWQ's w_bit, transformers' bits).
    for key in keys:
        if q.get(key) is not None:
            return q[key]
    return default


def _group(value: Any, method: str, supported: str) -> int | None:
    group = int(value)
    if group == -1:
        return None  # one scale per output row
    if group <= 0:
        raise ValueError(f"{method} group_size {value!r} is not supported; noria loads {supported}")
    return group


def _awq(q: Mapping[str, Any]) -> QuantSpec:
    def refuse(what: str) -> ValueError:
        return ValueError(f"{what} is not supported yet; noria loads {AWQ_SUPPORTED}")

    version = str(q.get("version") or "gemm").lower()
    if version != "gemm":
        raise refuse(f"AWQ version {version!r} (another packing of the weights)")
    backend = str(q.get("backend") or "autoawq").lower()
    if backend != "autoawq":
        raise refuse(f"AWQ backend {backend!r} (its packing differs from AutoAWQ's)")
    bits = int(_first(q, ("bits", "w_bit"), 4))
    if bits != 4:
        raise refuse(f"AWQ with {bits}-bit weights")
    if not q.get("zero_point", True):
        raise refuse("AWQ without zero points (zero_point false)")
    group = _group(_first(q, ("group_size", "q_group_size"), 128), "AWQ", AWQ_SUPPORTED)
    scheme = WeightScheme(4, group, False, packed=True, act_int8=False, layout="awq")
    # vLLM skips a module whose name contains any entry (a substring match, not a suffix one).
    skipped = tuple("re:.*" + re.escape(str(m)) for m in q.get("modules_to_not_convert") or ())
    # AutoAWQ quantizes the decoder layers only: the lm_head stays float.
    return QuantSpec(method="awq", groups=((("Linear",), scheme),), ignore=("lm_head", *skipped),
                     label=_label(scheme))


def _gptq(q: Mapping[str, Any]) -> QuantSpec:
    def refuse(what: str) -> ValueError:
        return ValueError(f"{what} is not supported yet; noria loads {GPTQ_SUPPORTED}")

    if q.get("dynamic"):
        raise refuse("GPTQ per-module overrides (dynamic)")
    bits = int(q.get("bits", 4))
    if bits not in (4, 8):
        raise refuse(f"GPTQ with {bits}-bit weights")
    fmt = str(_first(q, ("checkpoint_format", "format"), "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"GPTQ checkpoint_format {fmt!r}")
    if q.get("lm_head"):
        raise refuse("a GPTQ-quantized lm_head")
    group = _group(q.get("group_size", 128), "GPTQ", GPTQ_SUPPORTED)
    # Per channel, every feature is in the one group: activation order changes nothing.
    act_order = bool(q.get("desc_act", False)) and group is not None
    scheme = WeightScheme(bits, group, bool(q.get("sym", True)), packed=True, act_int8=False, layout=fmt,
                          act_order=act_order)
    # Only the modules named (block-relative, "self_attn.q_proj") are quantized where the config
    # lists them; the others, and the lm_head, are float.
    listed = q.get("modules_in_block_to_quantize")
    targets = tuple(str(m) for part in listed for m in ([part] if isinstance(part, str) else part)) \
        if listed else ("Linear",)
    return QuantSpec(method="gptq", groups=((targets, scheme),), ignore=("lm_head",), label=_label(scheme))


def _label(s: WeightScheme) -> str:
    parts = [s.name, "per channel" if s.group is None else f"g{s.group}"]
    if not s.symmetric:
        parts.append("zero points")
    if s.act_order:
        parts.append("desc_act")
    if s.layout == "gptq_v2":
        parts.append("gptq_v2")
    return " ".join(parts)


def checkpoint_shapes(scheme: WeightScheme, name: str, rows: int, cols: int) -> dict[str, tuple[int, ...] | None]:
    """The tensors a checkpoint stores for one AWQ or GPTQ module of `rows` output and `cols`
    input features, by name, with their shapes (protocol/checkpoint.py checks them before any
    process starts; the worker's converters check them again as they read)."""
    groups = scheme.groups(cols)
    if scheme.layout == "awq":
        return {f"{name}.qweight": (cols, rows // 8), f"{name}.qzeros": (groups, rows // 8),
                f"{name}.scales": (groups, rows)}
    per_word = 32 // scheme.bits
    out: dict[str, tuple[int, ...] | None] = {
        f"{name}.qweight": (cols // per_word, rows), f"{name}.qzeros": (groups, rows // per_word),
        f"{name}.scales": (groups, rows)}
    if scheme.act_order:  # without it, g_idx says nothing the group size does not (and may be absent)
        out[f"{name}.g_idx"] = (cols,)
    return out
