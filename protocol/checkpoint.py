"""A checkpoint's pre-flight check, torch-free: one clear sentence before any process starts.

A worker that meets a bad checkpoint fails deep in torch or safetensors with a
traceback; the frontend checks the cheap things first: config.json readable,
the architecture one the worker implements, every safetensors file whole
(header readable, every tensor's bytes inside the file), every shard an index
names present, and the Llama-family tensors (a mixture-of-experts layer's router and
experts in either layout the worker loads) both present and shaped as config.json
says. It reads headers only, never weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# Mirrors worker/models/spec.py SUPPORTED_ARCHITECTURES (a test keeps them equal):
# the worker imports torch, which the frontend must not.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class CheckpointError(ValueError):
    """A checkpoint the engine cannot load; the message is one sentence naming what is wrong."""


def check_checkpoint(folder: str | Path) -> None:
    """Raise CheckpointError naming the first problem found, or return."""
    folder = Path(folder)
    cfg = _config(folder)
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES] if archs else \
        [_BY_MODEL_TYPE[t] for t in [cfg.get("model_type")] if t in _BY_MODEL_TYPE]
    if not known:
        raise CheckpointError(f"{folder} holds a model of architecture {archs or cfg.get('model_type')}, which noria "
                              f"does not implement (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if known[0] in _GEMMA:
        # transformers' Gemma configs default to these; config.json may leave them out.
        cfg = {"tie_word_embeddings": True, "head_dim": 256, **cfg}
    sparse = _sparse_layers(cfg, known[0])
    _check_rope(cfg)
    expected = _expected_shapes(cfg)
    if known[0] == "Phi3ForCausalLM":
        expected = _phi3_shapes(expected)
    expected.update(_gemma_shapes(cfg, known[0]))
    expected.update(_expert_shapes(cfg, known[0]) if sparse else {})
    present: set[str] = set()
    for file in _weight_files(folder):
        for name, shape in _header_shapes(file).items():
            present.add(name.removeprefix("model."))
            want = expected.get(_generic(name))
            if want is not None and tuple(shape) != want:
                raise CheckpointError(f"{file}: tensor {name} has shape {tuple(shape)} but config.json implies "
                                      f"{want}: the weights do not belong to this config")
    missing = sorted(_required(cfg, expected, sparse) - present) + _missing_experts(cfg, known[0], sparse, present)
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} weight tensor(s) config.json requires (first: "
                              f"{missing[0]}): the weights are incomplete or belong to another config")


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


def _required(cfg: dict[str, Any], expected: dict[str, tuple[int, ...]], sparse: set[int]) -> set[str]:
    """Every Llama-family tensor name (layer index kept) the worker cannot run without; a sparse
    layer's experts, which come in one of several layouts, are `_missing_experts`'s to check."""
    try:
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError("config.json lacks a usable num_hidden_layers for a Llama-family model") from None
    names = {n for n in expected if not n.startswith("layers.N.")}
    if cfg.get("tie_word_embeddings"):
        names.discard("lm_head.weight")
    per_layer = [n for n in expected if n.startswith("layers.N.") and not n.startswith(_SPARSE_PREFIXES)]
    return names | {n.replace(".N.", f".{i}.", 1) for n in per_layer for i in range(layers)
                    if not (i in sparse and n.startswith(_DENSE_MLP))}


# Mixture of experts (worker/models/moe.py): a sparse layer's MLP is a router and experts,
# saved per expert (the hub's names: Mixtral's block_sparse_moe w1 = gate, w3 = up, w2 = down,
# the Qwen families' mlp.experts.E.gate/up/down_proj) or fused as transformers 5 holds them
# ([E, 2I, H] gate_up_proj, [E, H, I] down_proj).
_DENSE_MLP = ("layers.N.mlp.gate_proj.", "layers.N.mlp.up_proj.", "layers.N.mlp.down_proj.")
_SPARSE_PREFIXES = ("layers.N.mlp.experts.", "layers.N.block_sparse_moe.", "layers.N.mlp.gate.",
                    "layers.N.mlp.shared_expert")
_EXPERT_PARTS = {"MixtralForCausalLM": ("w1", "w3", "w2")}  # gate, up, down
_QWEN_PARTS = ("gate_proj", "up_proj", "down_proj")


def _sparse_layers(cfg: dict[str, Any], arch: str) -> set[int]:
    """The layers whose MLP is a mixture of experts, as transformers' modelling code picks them."""
    try:
        layers = int(cfg["num_hidden_layers"])
        if arch == "MixtralForCausalLM":
            return set(range(layers))
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return set()
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"config.json lacks usable mixture-of-experts sizes for {arch}") from None
    return {i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0}


def _expert_shapes(cfg: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a sparse layer's tensors, in every layout the worker loads."""
    try:
        hidden = int(cfg["hidden_size"])
        if arch == "MixtralForCausalLM":
            experts, inter, shared = int(cfg["num_local_experts"]), int(cfg["intermediate_size"]), 0
        else:
            experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
            inter = int(cfg["moe_intermediate_size"])
            shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json lacks a usable {e} for {arch}") from None
    gate, up, down = _EXPERT_PARTS.get(arch, _QWEN_PARTS)
    out: dict[str, tuple[int, ...]] = {}
    for block in ("mlp", "block_sparse_moe"):
        b = f"layers.N.{block}."
        out[b + "gate.weight"] = (experts, hidden)
        out[b + f"experts.N.{gate}.weight"] = out[b + f"experts.N.{up}.weight"] = (inter, hidden)
        out[b + f"experts.N.{down}.weight"] = (hidden, inter)
        out[b + "experts.gate_up_proj"] = (experts, 2 * inter, hidden)
        out[b + "experts.down_proj"] = (experts, hidden, inter)
    if shared:
        b = "layers.N.mlp.shared_expert."
        out[b + "gate_proj.weight"] = out[b + "up_proj.weight"] = (shared, hidden)
        out[b + "down_proj.weight"] = (hidden, shared)
        out["layers.N.mlp.shared_expert_gate.weight"] = (1, hidden)
    return out


def _missing_experts(cfg: dict[str, Any], arch: str, sparse: set[int], present: set[str]) -> list[str]:
    """The first tensors a sparse layer lacks in the layout its checkpoint uses."""
    if not sparse:
        return []
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    gate, up, down = _EXPERT_PARTS.get(arch, _QWEN_PARTS)
    shared = arch == "Qwen2MoeForCausalLM" and bool(cfg.get("shared_expert_intermediate_size"))
    missing: list[str] = []
    for i in sorted(sparse):
        hub = f"layers.{i}.block_sparse_moe."
        block = "block_sparse_moe" if {hub + "gate.weight", hub + f"experts.0.{gate}.weight",
                                       hub + "experts.gate_up_proj"} & present else "mlp"
        b = f"layers.{i}.{block}."
        need = [b + "gate.weight"]
        parts = ([] if b + "experts.gate_up_proj" in present else [gate, up]) + \
            ([] if b + "experts.down_proj" in present else [down])
        need += [b + f"experts.{e}.{part}.weight" for e in range(experts) for part in parts]
        if shared:
            need += [f"layers.{i}.mlp.shared_expert.{p}.weight" for p in _QWEN_PARTS]
            need.append(f"layers.{i}.mlp.shared_expert_gate.weight")
        missing += [n for n in need if n not in present]
    return missing


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return cfg


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


_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _gemma_shapes(cfg: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    """Gemma's norms around the MLP, and Gemma 3's per-head q/k norms; none for other families."""
    if arch not in _GEMMA:
        return {}
    hidden, head_dim = int(cfg["hidden_size"]), int(cfg["head_dim"])
    out = {"layers.N.pre_feedforward_layernorm.weight": (hidden,),
           "layers.N.post_feedforward_layernorm.weight": (hidden,)}
    if arch == "Gemma3ForCausalLM":
        out["layers.N.self_attn.q_norm.weight"] = out["layers.N.self_attn.k_norm.weight"] = (head_dim,)
    return out


# Mirrors worker/models/spec.py SUPPORTED_ROPE_TYPES (a test keeps them equal); "su" is
# Phi-3's first name for longrope.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _check_rope(cfg: dict[str, Any]) -> None:
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind != "su" and kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"config.json asks for rope type {kind!r}, which noria does not implement "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _phi3_shapes(expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Phi-3 saves q/k/v as one qkv_proj and gate/up as one gate_up_proj (rows stacked)."""
    out = dict(expected)
    layer = "layers.N."
    q, k, v = (out.pop(layer + f"self_attn.{p}_proj.weight") for p in "qkv")
    gate, up = out.pop(layer + "mlp.gate_proj.weight"), out.pop(layer + "mlp.up_proj.weight")
    out[layer + "self_attn.qkv_proj.weight"] = (q[0] + k[0] + v[0], q[1])
    out[layer + "mlp.gate_up_proj.weight"] = (gate[0] + up[0], gate[1])
    return out


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Llama-family tensors whose shapes config.json fixes (others are not checked here)."""
    try:
        hidden, inter, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"config.json lacks a usable {e} for a Llama-family model") from None
    layer = "layers.N."
    return {
        "embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "norm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": (inter, hidden), layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
        layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
    }
