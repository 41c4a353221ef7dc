"""FP8 checkpoints, read into WeightSchemes (protocol/quant_config.py): torch-free.

Three ways a model gets FP8 (e4m3) weights, as vLLM takes them:

- compressed-tensors `float-quantized` (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK): one
  scale per tensor or per output row (`weight_scale`), or one per 128 x 128 block (strategy
  "block"); activations float (weight-only), dynamic per token (per token and group of 128
  for blocks), or static (one calibrated `input_scale` per tensor).
- `quant_method: fp8` (transformers' FineGrainedFP8, the FP8 Qwen3 and DeepSeek checkpoints):
  `weight_block_size` [128, 128] with `weight_scale_inv` [ceil(N / 128), ceil(K / 128)], or
  without blocks one `weight_scale` per tensor; `activation_scheme` dynamic or static.
- online (`--quantization fp8`): a float checkpoint's linear layers (not the embedding, not the
  lm_head) quantized at load, one scale per output row, dynamic per-token activations.

A block-scaled weight is held as per-row x per-group scales (group = the block's width, each
block's scale repeated over its rows), so only square blocks are taken. Everything else (4-bit
floats such as NVFP4, e5m2 weights, asymmetric or dynamic weights, other activation rules) is
refused in one sentence here, before a weight is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from noria.protocol.quant_config import QuantSpec, WeightScheme

if TYPE_CHECKING:
    from noria.protocol.model_spec import ModelSpec

SUPPORTED_FP8 = ("FP8 e4m3 weights: compressed-tensors float-quantized (tensor, channel or square block scales; "
                 "float, dynamic per-token or static per-tensor activations), quant_method fp8 (per-tensor or "
                 "square weight_block_size), and --quantization fp8 of a float checkpoint")


def _scheme(group: int | None, act: str, layout: str) -> WeightScheme:
    return WeightScheme(8, group, True, packed=False, act_int8=False, kind="fp8", layout=layout, fp8_act=act)


def _square_block(block: Any, what: str) -> int:
    """The side of a square [b, b] block; ValueError otherwise."""
    if (not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) for b in block)
            or block[0] != block[1] or block[0] <= 0):
        raise ValueError(f"{what} {block!r} is not supported; noria takes square blocks such as [128, 128] "
                         f"({SUPPORTED_FP8})")
    return int(block[0])


def fp8_quant(q: Mapping[str, Any]) -> QuantSpec:
    """`quant_method: fp8`'s config (vLLM's Fp8Config keys). The lm_head stays float, as vLLM keeps it."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 {fmt} weights are not supported; noria loads {SUPPORTED_FP8}")
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {act!r} is not supported; noria loads {SUPPORTED_FP8}")
    block = q.get("weight_block_size")
    group = None if block is None else _square_block(block, "fp8 weight_block_size")
    if group is not None and act == "static":
        raise ValueError("fp8 block-scaled weights with static activation scales are not supported "
                         "(the blocks' activations are quantized per token and group)")
    ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
    if isinstance(ignored, str):
        ignored = [ignored]
    return QuantSpec(method="fp8", groups=((("Linear",), _scheme(group, act, "fp8")),),
                     ignore=(*(str(i) for i in ignored), "lm_head"))


def compressed_fp8_scheme(name: str, group: Mapping[str, Any], fmt: Any) -> WeightScheme:
    """The scheme of a compressed-tensors config group whose weights are floats."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"config group {name!r}: {what} is not supported yet; noria loads {SUPPORTED_FP8}")

    w, a = group["weights"], group.get("input_activations")
    bits = int(w.get("num_bits", 0))
    if bits != 8:
        raise refuse(f"{bits}-bit float weights ({fmt})")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise refuse(f"8-bit float weights in format {fmt!r}")
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization")
    if not w.get("symmetric", True):
        raise refuse("asymmetric fp8 weights")
    strategy = w.get("strategy")
    if strategy in ("tensor", "channel"):
        block = None
    elif strategy == "block":
        block = _square_block(w.get("block_structure"), f"config group {name!r}: block_structure")
    else:
        raise refuse(f"fp8 weight strategy {strategy!r}")
    if a is None:
        return _scheme(block, "", "compressed-tensors")
    if (not isinstance(a, Mapping) or a.get("type", "int") != "float" or int(a.get("num_bits", 0)) != 8
            or not a.get("symmetric", True)):
        raise refuse(f"activations quantized as {dict(a) if isinstance(a, Mapping) else a} with fp8 weights")
    a_strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if dynamic and (a_strategy == "token" and block is None
                    or a_strategy == "group" and block is not None and a.get("group_size") == block):
        return _scheme(block, "dynamic", "compressed-tensors")
    if not dynamic and a_strategy == "tensor" and block is None:
        return _scheme(None, "static", "compressed-tensors")
    raise refuse(f"fp8 activations ({a_strategy} strategy, dynamic {dynamic}) with "
                 f"{strategy} weights (noria computes dynamic per-token, per-token-group for blocks, "
                 "or static per-tensor)")


ONLINE_FP8 = "online per-channel"


def online_quant(spec: ModelSpec, choice: str | None) -> ModelSpec:
    """`spec` with --quantization's scheme for every linear layer but the lm_head (the embedding is
    no linear layer); ValueError, in one sentence, where the checkpoint is quantized already."""
    if choice is None:
        return spec
    if choice != "fp8":
        raise ValueError(f"--quantization {choice!r} is not supported; noria quantizes online to fp8")
    if spec.quantization is not None:
        raise ValueError(f"--quantization fp8 quantizes a float checkpoint at load, and this one is quantized "
                         f"already ({spec.quantization.describe}); drop the flag to load it as it is")
    quant = QuantSpec(method="fp8", groups=((("Linear",), _scheme(None, "dynamic", "online")),),
                      ignore=("lm_head",), label=ONLINE_FP8)
    return dataclasses.replace(spec, quantization=quant)


def checkpoint_shapes(scheme: WeightScheme, name: str, rows: int, cols: int) -> dict[str, tuple[int, ...] | None]:
    """What an fp8 checkpoint stores for one linear module (worker/models/quant_fp8.py reads the
    same), for protocol/checkpoint.py's pre-flight check; None: a shape not checked there."""
    scale = "weight_scale_inv" if scheme.layout == "fp8" and scheme.group is not None else "weight_scale"
    block = scheme.group
    out: dict[str, tuple[int, ...] | None] = {
        f"{name}.weight": (rows, cols),
        f"{name}.{scale}": None if block is None else (-(-rows // block), -(-cols // block))}
    if scheme.fp8_act == "static":
        out[f"{name}.input_scale"] = None
    return out
