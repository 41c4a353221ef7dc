"""A checkpoint's `quantization_config`, read once into a torch-free `QuantSpec`.

compressed-tensors (what llm-compressor writes) is read as vLLM reads it: config groups, each a
scheme for the modules its `targets` name ("Linear", a module name, or "re:" + a regex), and an
`ignore` list of modules kept in float. What a scheme may say is narrowed here to what the
worker's linear kinds compute; anything else is refused with one sentence naming it, before
a weight is read, so that a checkpoint never loads into a model that computes something else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = ("compressed-tensors int8 W8A8 (int-quantized, channel weights, dynamic per-token activations), "
             "W8A16 and W4A16 (pack-quantized, group or channel, symmetric or with zero points)")


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is stored and computed."""

    bits: int  # 4 or 8
    group: int | None  # input features per scale; None: one scale per output row
    symmetric: bool  # False: an integer zero point per group
    packed: bool  # values packed into int32 words (pack-quantized), else one int8 per value
    act_int8: bool  # activations quantized per token to int8 on the fly (W8A8)
    # A float minimum per group, subtracted after scaling: w = q * scale - min (GGUF's Q4_K,
    # values q in [0, 15]); exclusive of zero points.
    minimum: bool = field(default=False, kw_only=True)
    # The values' type: "int" (int8 containers) or "fp8" (float8_e4m3fn, scaled per row or group).
    kind: str = field(default="int", kw_only=True)
    # How the checkpoint stores the layer (which tensors, packed how): "compressed-tensors",
    # "awq", "gptq", "fp8" (quant_method fp8), "gguf", or "online" (a float weight quantized at load).
    layout: str = field(default="compressed-tensors", kw_only=True)
    # The input features are stored in activation order (GPTQ's desc_act, a g_idx per feature):
    # the layer permutes its input so that its groups are contiguous.
    act_order: bool = field(default=False, kw_only=True)
    # An fp8 scheme's activations, as the checkpoint was calibrated: "" float (weight-only),
    # "dynamic" (fp8 per token, or per token and group of a block-scaled weight), "static" (one
    # input_scale per tensor). protocol/quant_fp8.py reads them; the GPU kind computes them.
    fp8_act: str = field(default="", kw_only=True)

    def groups(self, in_features: int) -> int:
        """Scales per output row; ValueError where the group does not divide the layer."""
        if self.group is None:
            return 1
        if in_features % self.group:
            raise ValueError(f"group size {self.group} does not divide the layer's {in_features} input features")
        return in_features // self.group

    @property
    def name(self) -> str:
        if self.kind == "fp8":
            return "FP8" + (f"-{self.fp8_act}" if self.fp8_act else "")
        return f"W{self.bits}A{8 if self.act_int8 else 16}" + ("min" if self.minimum else "")


@dataclass(frozen=True)
class QuantSpec:
    method: str  # quantization_config's quant_method
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), in config order
    ignore: tuple[str, ...] = ()
    label: str = ""  # what `describe` says, where the groups alone would not say it (GGUF's types)

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of a checkpoint module ("model.layers.0.mlp.gate_proj"), None to keep it float.
        A name in `ignore` wins; otherwise the first group whose targets match. Every module the
        worker builds is a Linear, so the target "Linear" matches them all."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None

    def fused_scheme(self, modules: list[str]) -> WeightScheme | None:
        """The one scheme of the checkpoint modules fused into one layer (q/k/v, gate/up):
        ValueError where they differ, since one kernel computes them together."""
        schemes = {m: self.scheme_for(m) for m in modules}
        if len(set(schemes.values())) > 1:
            detail = ", ".join(f"{m}: {s.name if s else 'float'}" for m, s in schemes.items())
            raise ValueError(f"modules fused into one layer are quantized differently ({detail})")
        return schemes[modules[0]]

    @property
    def describe(self) -> str:
        if self.label:
            return f"{self.method} {self.label}"
        names = sorted({s.name + ("" if s.group is None else f" g{s.group}") + ("" if s.symmetric else " asym")
                        for _, s in self.groups})
        return f"{self.method} {', '.join(names)}"


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def read_quant(config: Mapping[str, Any]) -> QuantSpec | None:
    """The QuantSpec of config.json's `quantization_config` (None without one); ValueError names
    the first thing noria does not compute."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError("quantization_config is not a JSON object")
    method = str(q.get("quant_method"))
    if method == "gguf":
        from noria.protocol.gguf_quant import gguf_quant

        return gguf_quant(q)
    if method in ("awq", "gptq"):
        from noria.protocol.quant_awq_gptq import awq_gptq_quant

        return awq_gptq_quant(q)
    if method == "fp8":
        from noria.protocol.quant_fp8 import fp8_quant

        return fp8_quant(q)
    if method != "compressed-tensors":
        raise ValueError(f"quantization method {method!r} is not supported yet; noria loads {SUPPORTED}")
    if q.get("kv_cache_scheme"):
        from noria.protocol.kv_cache_scheme import check_kv_cache_scheme

        check_kv_cache_scheme(q["kv_cache_scheme"])  # its scales are read by the worker (worker/kv_fp8.py)
        if not q.get("config_groups"):
            return None  # only the KV cache was calibrated: the weights are float
    sparsity = q.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    if q.get("transform_config"):
        raise ValueError("compressed-tensors transforms (rotations) are not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    top_format = q.get("format")
    out = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ValueError(f"config group {name!r} is not a JSON object")
        targets = group.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        out.append((tuple(str(t) for t in targets), _scheme(name, group, group.get("format") or top_format)))
    ignore = q.get("ignore") or []
    return QuantSpec(method=method, groups=tuple(out), ignore=tuple(str(i) for i in ignore))


def _scheme(name: str, group: Mapping[str, Any], fmt: Any) -> WeightScheme:
    def refuse(what: str) -> ValueError:
        return ValueError(f"config group {name!r}: {what} is not supported yet; noria loads {SUPPORTED}")

    w, a = group.get("weights"), group.get("input_activations")
    if group.get("output_activations"):
        raise refuse("output activation quantization")
    if not isinstance(w, Mapping):
        raise refuse("a group without weight quantization")
    bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy")
    if kind == "float":
        from noria.protocol.quant_fp8 import compressed_fp8_scheme

        return compressed_fp8_scheme(name, group, fmt)
    if kind != "int":
        raise refuse(f"{kind} {bits}-bit weights ({fmt})")
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization")
    if w.get("actorder") == "group":
        raise refuse("activation-ordered groups (actorder 'group', a g_idx per weight)")
    if strategy not in ("channel", "group", "tensor"):
        raise refuse(f"weight strategy {strategy!r}")
    group_size = int(w["group_size"]) if strategy == "group" and w.get("group_size") else None
    if strategy == "group" and group_size is None:
        raise refuse("group strategy without a group_size")
    symmetric = bool(w.get("symmetric", True))
    if fmt == "pack-quantized":
        if bits not in (4, 8) or a:
            raise refuse(f"pack-quantized W{bits} with activations {dict(a) if a else None}")
        return WeightScheme(bits, group_size, symmetric, packed=True, act_int8=False)
    if fmt == "int-quantized":
        if bits != 8 or not symmetric or group_size is not None:
            raise refuse(f"int-quantized weights of {bits} bits, {strategy} strategy, symmetric {symmetric}")
        if a is None:
            return WeightScheme(8, None, True, packed=False, act_int8=False)
        if (not isinstance(a, Mapping) or a.get("type", "int") != "int" or int(a.get("num_bits", 0)) != 8
                or not a.get("dynamic") or a.get("strategy") != "token" or not a.get("symmetric", True)):
            raise refuse(f"int8 activations quantized as {dict(a) if isinstance(a, Mapping) else a} "
                         "(noria computes dynamic per-token symmetric int8)")
        return WeightScheme(8, None, True, packed=False, act_int8=True)
    raise refuse(f"format {fmt!r}")
