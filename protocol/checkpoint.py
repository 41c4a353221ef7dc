"""A checkpoint's pre-flight check, torch-free: one clear sentence before any process starts.

A worker that meets a bad checkpoint fails deep in torch or safetensors with a
traceback; the frontend checks the cheap things first: config.json readable and
describing a model noria implements (its `ModelSpec`), every safetensors file whole
(header readable, every tensor's bytes inside the file), every shard an index
names present, and every tensor the spec's layers need (a mixture-of-experts layer's
router and experts in either layout the worker loads) both present and shaped as the
spec says. It reads headers only, never weights. A GGUF file's folder view (frontend/gguf_view.py)
is checked against the file's own header (protocol/gguf_check.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from noria.protocol.families import SUPPORTED_ARCHITECTURES, find_family
from noria.protocol.model_spec import ModelSpec, model_spec, read_config
from noria.protocol.rope_config import SUPPORTED_ROPE_TYPES, rope_kind, rope_params

_MAX_HEADER = 100 * 2**20  # safetensors' own limit

Shapes = dict[str, tuple[int, ...] | None]


class CheckpointError(ValueError):
    """A checkpoint the engine cannot load; the message is one sentence naming what is wrong."""


def check_checkpoint(folder: str | Path, weights: bool = True) -> ModelSpec:
    """Raise CheckpointError naming the first problem found, or return the checkpoint's spec.
    `weights` False (--load-format dummy): config.json alone, the weights are made at load."""
    folder = Path(folder)
    spec = _spec(folder)
    if not weights:
        if spec.quantization is not None and spec.quantization.method == "gguf":
            raise CheckpointError("--load-format dummy makes weights from config.json; a GGUF file brings "
                                  "its own: drop the flag")
        return spec
    if spec.quantization is not None and spec.quantization.method == "gguf":
        return _check_gguf(folder, spec)
    sparse = {i for i in range(spec.num_layers) if spec.is_sparse(i)}
    expected = {**_expected_shapes(spec), **_expert_shapes(spec)}
    present: set[str] = set()
    for file in _weight_files(folder):
        for name, shape in _header_shapes(file).items():
            present.add(name.removeprefix("model."))
            key = name.removeprefix("model.")
            want = expected[key] if key in expected else expected.get(_generic(name))
            if want is not None and tuple(shape) != want:
                raise CheckpointError(f"{file}: tensor {name} has shape {tuple(shape)} but config.json implies "
                                      f"{want}: the weights do not belong to this config")
    missing = sorted(_required(spec, expected, sparse) - present)
    missing += [n for n in _missing_experts(spec, sparse, present) if n not in missing]  # quantized: in both
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} weight tensor(s) config.json requires (first: "
                              f"{missing[0]}): the weights are incomplete or belong to another config")
    return spec


def check_mtp_layer(folder: str | Path, spec: ModelSpec) -> None:
    """The checkpoint's first MTP layer (MiMo's `model.mtp_layers.0.*`: a decoder layer of the
    model's shapes, its norms, and `input_proj` from twice the width), present and shaped as
    `--speculative-config` method mtp reads it; CheckpointError names the first problem."""
    hidden = spec.hidden_size
    want: Shapes = {n.replace("layers.N.", "mtp_layers.0.", 1): shape for n, shape in _expected_shapes(spec).items()
                    if n.startswith("layers.N.")}
    want.update({f"mtp_layers.0.{n}.weight": (hidden,) for n in ("token_layernorm", "hidden_layernorm",
                                                                  "final_layernorm")})
    want["mtp_layers.0.input_proj.weight"] = (hidden, 2 * hidden)
    found = {name.removeprefix("model."): (file, shape) for file in _weight_files(Path(folder))
             for name, shape in _header_shapes(file).items()}
    for name, shape in want.items():
        if name not in found:
            raise CheckpointError(f"{folder} lacks model.{name}, which config.json's num_nextn_predict_layers "
                                  "promises: its MTP layer cannot draft")
        file, got = found[name]
        if tuple(got) != shape:
            raise CheckpointError(f"{file}: tensor model.{name} has shape {tuple(got)} but config.json implies {shape}")


def _check_gguf(folder: Path, spec: ModelSpec) -> ModelSpec:
    """A GGUF file's view (frontend/gguf_view.py): the file's header against the spec's float shapes."""
    from dataclasses import replace

    from noria.protocol.gguf_check import check_gguf

    plain = replace(spec, quantization=None)
    expected = _expected_shapes(plain)
    check_gguf(str(read_config(folder)["quantization_config"]["gguf_file"]), spec.architecture, expected,
               _required(plain, expected, set()), _generic)
    return spec


def _spec(folder: Path) -> ModelSpec:
    """The checkpoint's spec, or the one sentence saying why config.json gives none."""
    try:
        cfg = read_config(folder)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    family = find_family(cfg)
    if family is None:
        archs = cfg.get("architectures") or cfg.get("model_type")
        raise CheckpointError(f"{folder} holds a model of architecture {archs}, which noria does not implement "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    unknown = sorted(_rope_kinds(cfg) - set(SUPPORTED_ROPE_TYPES))
    if unknown:
        raise CheckpointError(f"config.json asks for rope type {unknown[0]!r}, which noria does not implement "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    try:
        return model_spec(cfg)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e}, which a {family.architecture} needs") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"config.json does not describe a {family.architecture} noria can run: {e}") from None


def _rope_kinds(cfg: Mapping[str, Any]) -> set[str]:
    """The rope types config.json names: one, or one per layer type where it nests them."""
    params = cfg.get("rope_parameters")
    nested = [p for p in params.values() if isinstance(p, Mapping)] if isinstance(params, Mapping) else []
    return {rope_kind(p) for p in [rope_params(cfg), *nested]}


def _expected_shapes(spec: ModelSpec) -> Shapes:
    """Every dense tensor the spec's layers load, by generic name (`layers.N.`), with its shape."""
    hidden, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv, layer = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, "layers.N."
    out: Shapes = {"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "norm.weight": (hidden,)}
    attn = {"qkv_proj": q + 2 * kv} if spec.fused_checkpoint else {"q_proj": q, "k_proj": kv, "v_proj": kv}
    mlp = {"gate_up_proj": 2 * inter} if spec.fused_checkpoint else {"gate_proj": inter, "up_proj": inter}
    linears = [(f"self_attn.{part}", rows, hidden, spec.qkv_bias) for part, rows in attn.items()]
    linears.append(("self_attn.o_proj", hidden, q, spec.o_bias))
    linears += [(f"mlp.{part}", rows, hidden, spec.mlp_bias) for part, rows in mlp.items()]
    linears.append(("mlp.down_proj", hidden, inter, spec.mlp_bias))
    for name, rows, cols, bias in linears:
        if spec.quantization is None:
            out[f"{layer}{name}.weight"] = (rows, cols)
        else:  # each layer's own: an `ignore` list may name single modules
            for i in range(spec.num_layers):
                if not (spec.is_sparse(i) and name.startswith("mlp.")):  # a sparse layer's are its experts'
                    out.update(_linear_shapes(spec, f"layers.{i}.{name}", rows, cols))
        if bias:
            out[f"{layer}{name}.bias"] = (rows,)
    if spec.quantization is not None:
        out.pop("lm_head.weight")
        out.update(_linear_shapes(spec, "lm_head", vocab, hidden))
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if spec.sandwich_norms else []
    out.update({f"{layer}{n}.weight": (hidden,) for n in norms})
    if spec.qk_norm:
        out[f"{layer}self_attn.q_norm.weight"] = out[f"{layer}self_attn.k_norm.weight"] = (spec.head_dim,)
    return out


def _linear_shapes(spec: ModelSpec, name: str, rows: int, cols: int) -> Shapes:
    """What a quantized checkpoint stores for one linear module (worker/models/quant_linear.py
    reads the same), by name; a shape of None is not checked (one scale per row, or one)."""
    assert spec.quantization is not None
    scheme = spec.quantization.scheme_for(name if name == "lm_head" else f"model.{name}")
    if scheme is None:
        return {f"{name}.weight": (rows, cols)}
    if scheme.layout in ("awq", "gptq", "gptq_v2"):
        from noria.protocol.quant_awq_gptq import checkpoint_shapes

        return checkpoint_shapes(scheme, name, rows, cols)
    if scheme.kind == "fp8":
        from noria.protocol.quant_fp8 import checkpoint_shapes as fp8_shapes

        return fp8_shapes(scheme, name, rows, cols)
    groups = scheme.groups(cols)
    if not scheme.packed:
        return {f"{name}.weight": (rows, cols), f"{name}.weight_scale": None}
    per_word = 32 // scheme.bits
    out: Shapes = {f"{name}.weight_packed": (rows, -(-cols // per_word)), f"{name}.weight_scale": (rows, groups),
                   f"{name}.weight_shape": (2,)}
    if not scheme.symmetric:
        out[f"{name}.weight_zero_point"] = (-(-rows // per_word), groups)
    return out


def _required(spec: ModelSpec, expected: Shapes, sparse: set[int]) -> set[str]:
    """Every tensor name (layer index kept) the worker cannot run without; a sparse layer's
    experts, which come in one of several layouts, are `_missing_experts`'s to check."""
    names = {n for n in expected if not n.startswith("layers.N.")}
    if spec.tie_word_embeddings:
        names = {n for n in names if not n.startswith("lm_head.")}
    per_layer = [n for n in expected if n.startswith("layers.N.") and not n.startswith(_SPARSE_PREFIXES)]
    return names | {n.replace(".N.", f".{i}.", 1) for n in per_layer for i in range(spec.num_layers)
                    if not (i in sparse and n.startswith(_DENSE_MLP))}


# Mixture of experts (the worker's moe layer): a sparse layer's MLP is a router and experts,
# saved per expert under the hub's names (spec.expert_parts, below `mlp.` or Mixtral's
# `block_sparse_moe.`) or fused as transformers 5 holds them ([E, 2I, H] gate_up_proj,
# [E, H, I] down_proj). A shared expert is a dense MLP of Qwen2's names.
_DENSE_MLP = tuple(f"layers.N.mlp.{p}." for p in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"))
_SPARSE_PREFIXES = ("layers.N.mlp.experts.", "layers.N.block_sparse_moe.", "layers.N.mlp.gate.",
                    "layers.N.mlp.shared_expert")


def _expert_shapes(spec: ModelSpec) -> Shapes:
    """The shapes of a sparse layer's tensors, in every layout the worker loads."""
    if not spec.num_experts:
        return {}
    hidden, experts, inter = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    gate, up, down = spec.expert_parts
    out: Shapes = {}
    for block in ("mlp", "block_sparse_moe"):
        b = f"layers.N.{block}."
        out[b + "gate.weight"] = (experts, hidden)
        out[b + f"experts.N.{gate}.weight"] = out[b + f"experts.N.{up}.weight"] = (inter, hidden)
        out[b + f"experts.N.{down}.weight"] = (hidden, inter)
        out[b + "experts.gate_up_proj"] = (experts, 2 * inter, hidden)
        out[b + "experts.down_proj"] = (experts, hidden, inter)
    shared = spec.shared_expert_intermediate_size
    if shared:
        b = "layers.N.mlp.shared_expert."
        out[b + "gate_proj.weight"] = out[b + "up_proj.weight"] = (shared, hidden)
        out[b + "down_proj.weight"] = (hidden, shared)
        out["layers.N.mlp.shared_expert_gate.weight"] = (1, hidden)
    if spec.quantization is not None:  # each expert's quantized tensors, under the block the formats use
        from noria.protocol.quant_moe import expert_block

        for i in (i for i in range(spec.num_layers) if spec.is_sparse(i)):
            for part, rows, cols in _expert_parts(spec):
                for e in range(experts):
                    out.update(_linear_shapes(spec, f"layers.{i}.{expert_block(spec)}.experts.{e}.{part}", rows, cols))
            for part, rows, cols in _shared_parts(spec):
                out.update(_linear_shapes(spec, f"layers.{i}.mlp.shared_expert.{part}", rows, cols))
    return out


def _expert_parts(spec: ModelSpec) -> list[tuple[str, int, int]]:
    inter, hidden = spec.moe_intermediate_size, spec.hidden_size
    return [(spec.expert_parts[0], inter, hidden), (spec.expert_parts[1], inter, hidden),
            (spec.expert_parts[2], hidden, inter)]


def _shared_parts(spec: ModelSpec) -> list[tuple[str, int, int]]:
    shared, hidden = spec.shared_expert_intermediate_size, spec.hidden_size
    return [("gate_proj", shared, hidden), ("up_proj", shared, hidden), ("down_proj", hidden, shared)] if shared else []


def _module_tensors(spec: ModelSpec, name: str, rows: int, cols: int) -> list[str]:
    """The tensors a checkpoint stores for one linear module: its weight, or its format's tensors."""
    return [f"{name}.weight"] if spec.quantization is None else list(_linear_shapes(spec, name, rows, cols))


def _missing_experts(spec: ModelSpec, sparse: set[int], present: set[str]) -> list[str]:
    """The first tensors a sparse layer lacks in the layout its checkpoint uses."""
    gate, up, down = spec.expert_parts
    missing: list[str] = []
    for i in sorted(sparse):
        hub = f"layers.{i}.block_sparse_moe."
        block = "block_sparse_moe" if {hub + "gate.weight", hub + f"experts.0.{gate}.weight",
                                       hub + "experts.gate_up_proj"} & present else "mlp"
        b = f"layers.{i}.{block}."
        need = [b + "gate.weight"]
        parts = ([] if b + "experts.gate_up_proj" in present else [gate, up]) + \
            ([] if b + "experts.down_proj" in present else [down])
        need += [t for e in range(spec.num_experts) for part, rows, cols in _expert_parts(spec) if part in parts
                 for t in _module_tensors(spec, b + f"experts.{e}.{part}", rows, cols)]
        if spec.shared_expert_intermediate_size:
            need += [t for p, rows, cols in _shared_parts(spec)
                     for t in _module_tensors(spec, f"layers.{i}.mlp.shared_expert.{p}", rows, cols)]
            need.append(f"layers.{i}.mlp.shared_expert_gate.weight")
        missing += [n for n in need if n not in present]
    return missing


def _weight_files(folder: Path) -> list[Path]:
    """The files the worker will read, in the worker's order of preference (worker/loader.py)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a readable safetensors index (no weight_map)") from None
        absent = [n for n in names if not (folder / n).is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that are not in the folder: {', '.join(absent[:4])}")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def _header_shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors header, after checking the file is whole."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{file} is truncated or not a safetensors file (its header does not fit in it)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise CheckpointError(f"{file} has an unreadable safetensors header (a truncated or corrupt file)") from None
    data = size - 8 - n
    shapes: dict[str, list[int]] = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        end = (info.get("data_offsets") or [0, 0])[1]
        if not isinstance(end, int) or end > data:
            raise CheckpointError(f"{file} is truncated: tensor {name} ends at byte {end} of {data} data bytes")
        shapes[name] = list(info.get("shape") or [])
    return shapes


def _generic(name: str) -> str:
    """`model.layers.7.mlp.up_proj.weight` -> `layers.N.mlp.up_proj.weight`."""
    parts = name.removeprefix("model.").split(".")
    return ".".join("N" if p.isdigit() else p for p in parts)
