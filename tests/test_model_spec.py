"""ModelSpec (protocol/model_spec.py) against transformers' own reading of the same config.json.

For every registered family, a tiny checkpoint transformers saved: `read_spec` agrees with
`AutoConfig.from_pretrained` (and with the tensors transformers wrote) on every fact both
have; the family's `defaults` and `aliases` are its transformers config class's; a key left
out of config.json reads as transformers assumes it; the window rules agree with transformers'
on configs without layer_types; and the torch-free readers import neither torch nor transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from noria.protocol.checkpoint import check_checkpoint
from noria.protocol.families import FAMILIES, find_family
from noria.protocol.model_spec import ModelSpec, model_spec, read_config, read_spec
from tests.tiny_models import make_checkpoint

# tests/tiny_models.py's architectures: one case or more per family.
CASES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma2",
         "gemma3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_checkpoint(arch, root / arch) for arch in CASES}


def _config_class(model_type: str) -> Any:
    from transformers import AutoConfig

    return type(AutoConfig.for_model(model_type))


def _transformers_reading(cfg: dict[str, Any]) -> Any:
    """The config transformers makes of a config.json dict (as from_pretrained does)."""
    return _config_class(cfg["model_type"]).from_dict(cfg)


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "np") as f:
        return {n.removeprefix("model."): tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118 (not iterable)


def _windows(hf: Any) -> tuple[int | None, ...]:
    """The sliding window of each layer as transformers' modelling code takes it: none where the
    config class has no sliding_window (Llama's), from layer_types where it has them, else
    config.sliding_window on every layer."""
    window = (getattr(hf, "sliding_window", None) or None) if hasattr(type(hf), "sliding_window") else None
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (window,) * hf.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def _reference(hf: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """transformers' reading of the config, and the layer structure its saved tensors show."""
    heads, layers = hf.num_attention_heads, hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope = hf.rope_parameters
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention")

    def has(part: str) -> bool:
        return any(part in name for name in shapes)

    sparse = tuple(any(n.startswith(f"layers.{i}.") and ".experts." in n for n in shapes) for i in range(layers))
    return {
        "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size, "intermediate_size": hf.intermediate_size,
        "num_layers": layers, "num_heads": heads, "num_kv_heads": hf.num_key_value_heads, "head_dim": head_dim,
        "rms_norm_eps": hf.rms_norm_eps, "max_position_embeddings": hf.max_position_embeddings,
        "tie_word_embeddings": hf.tie_word_embeddings, "dtype": str(hf.dtype).removeprefix("torch."),
        "sliding_windows": _windows(hf), "rope_type": full["rope_type"], "rope_theta": full["rope_theta"],
        "partial_rotary_factor": full.get("partial_rotary_factor", 1.0),
        "local_rope_theta": local["rope_theta"] if local else None,
        "activation": ACTIVATIONS[getattr(hf, "hidden_activation", None) or hf.hidden_act],
        "scale": (getattr(hf, "query_pre_attn_scalar", None) or head_dim) ** -0.5,
        "final_softcap": getattr(hf, "final_logit_softcapping", None),
        "qkv_bias": has("q_proj.bias") or has("qkv_proj.bias"), "o_bias": has("o_proj.bias"),
        "mlp_bias": has("mlp.down_proj.bias"), "qk_norm": has("q_norm.weight"),
        "sandwich_norms": has("pre_feedforward_layernorm"), "fused_checkpoint": has("qkv_proj"),
        "sparse_layers": sparse if any(sparse) else (),
        "num_experts": getattr(hf, "num_experts", 0) if any(sparse) else 0,
        "num_experts_per_tok": hf.num_experts_per_tok if any(sparse) else 0,
        "shared_expert_intermediate_size": next((s[0] for n, s in shapes.items() if "shared_expert.up_proj" in n), 0),
    }


def _read(spec: ModelSpec) -> dict[str, Any]:
    """The spec in _reference's terms."""
    moe = spec.num_experts > 0
    return {
        **{k: getattr(spec, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                         "num_kv_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                                         "tie_word_embeddings", "dtype", "sliding_windows", "activation", "scale",
                                         "final_softcap", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
                                         "sandwich_norms", "fused_checkpoint", "num_experts",
                                         "shared_expert_intermediate_size")},
        "rope_type": spec.rope.rope_type, "rope_theta": spec.rope.theta,
        "partial_rotary_factor": spec.rope.partial_rotary_factor,
        "local_rope_theta": spec.local_rope.theta if spec.local_rope else None,
        "sparse_layers": spec.sparse_layers if moe else (),
        "num_experts_per_tok": spec.num_experts_per_tok if moe else 0,
    }


def _known_to_transformers() -> list[Any]:
    """The families transformers implements (a made-up family has no reference to compare with;
    its own test holds it to an equivalent transformers network instead)."""
    from transformers import CONFIG_MAPPING

    return [f for f in FAMILIES.values() if f.model_type in CONFIG_MAPPING]


def test_every_family_has_a_case() -> None:
    from tests.tiny_models import tiny_config

    covered = [find_family({"model_type": tiny_config(arch).model_type}) for arch in CASES]
    known = {f.architecture for f in _known_to_transformers()}
    assert {f.architecture for f in covered if f} == known, "a family without a tiny checkpoint case"
    assert known, "no family transformers knows"


@pytest.mark.parametrize("arch", CASES)
def test_spec_agrees_with_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    from transformers import AutoConfig

    folder = checkpoints[arch]
    hf, shapes, spec = AutoConfig.from_pretrained(folder), _shapes(folder), read_spec(folder)
    assert spec.architecture == hf.architectures[0]
    assert _read(spec) == _reference(hf, shapes)
    if spec.num_experts:
        first = spec.sparse_layers.index(True)
        expert = {n.split(".")[-2]: s for n, s in shapes.items() if n.startswith(f"layers.{first}.")
                  and ".experts.0." in n}
        gate, up, down = spec.expert_parts
        assert set(expert) == {gate, up, down}
        assert expert[gate] == expert[up] == (spec.moe_intermediate_size, spec.hidden_size)
        assert expert[down] == (spec.hidden_size, spec.moe_intermediate_size)
        if hasattr(hf, "norm_topk_prob"):  # Mixtral's config has no switch: it always renormalises
            assert spec.norm_topk_prob == hf.norm_topk_prob
    check_checkpoint(folder)  # the pre-check derives every tensor it expects from this same spec


@pytest.mark.parametrize("family", _known_to_transformers(), ids=lambda f: f.model_type)
def test_defaults_and_aliases_are_the_config_class(family: Any) -> None:
    cls = _config_class(family.model_type)
    assert dict(family.aliases) == dict(cls.attribute_map)
    ref = cls()
    rope = ref.rope_parameters
    for key, value in family.defaults.items():
        if key == "rope_theta":  # transformers 5 keeps it in rope_parameters (per layer type for Gemma 3)
            assumed = rope.get("full_attention", rope)["rope_theta"]
        elif key == "rope_local_base_freq":
            assumed = rope["sliding_attention"]["rope_theta"]
        else:
            assumed = getattr(ref, key)
        assert value == assumed, f"{family.model_type}: {key} defaults to {assumed!r} in transformers, not {value!r}"


@pytest.mark.parametrize("arch", CASES)
def test_a_minimal_config_gives_the_same_spec(arch: str, checkpoints: dict[str, Path]) -> None:
    full = read_config(checkpoints[arch])
    defaults = _config_class(full["model_type"])().to_dict()
    minimal = {k: v for k, v in full.items() if k == "model_type" or k not in defaults or defaults[k] != v}
    assert len(minimal) < len(full)
    assert model_spec(minimal) == model_spec(full)


def _spec_or_error(cfg: dict[str, Any]) -> ModelSpec | str:
    try:
        return model_spec(cfg)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("arch", CASES)
def test_a_key_left_out_reads_as_transformers_assumes_it(arch: str, checkpoints: dict[str, Path]) -> None:
    """For each key of the saved config.json: the spec without it equals the spec with the value
    transformers' config class takes for it when it is left out (or both refuse alike)."""
    from huggingface_hub.errors import StrictDataclassError

    full = read_config(checkpoints[arch])
    for key in sorted(full):
        rest = {k: v for k, v in full.items() if k != key}
        try:
            assumed = _transformers_reading({**rest, "model_type": full["model_type"]}).to_dict().get(key)
        except (StrictDataclassError, ValueError):
            continue  # transformers refuses the config without it (its default contradicts another key)
        assert _spec_or_error(rest) == _spec_or_error({**rest, key: assumed}), f"{arch}: {key} left out"


WINDOW_EDITS = [{"sliding_window": 16}, {"sliding_window": 16, "use_sliding_window": False},
                {"sliding_window": 16, "use_sliding_window": True},
                {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1},
                {"sliding_window": None, "use_sliding_window": True}]


@pytest.mark.parametrize("arch", CASES)
def test_window_rules_agree_without_layer_types(arch: str, checkpoints: dict[str, Path]) -> None:
    full = {k: v for k, v in read_config(checkpoints[arch]).items() if k != "layer_types"}
    for edit in WINDOW_EDITS:
        cfg = {**full, **edit}
        assert model_spec(cfg).sliding_windows == _windows(_transformers_reading(cfg)), f"{arch}: {edit}"


def test_the_readers_import_neither_torch_nor_transformers() -> None:
    modules = ("model_spec", "checkpoint", "model_identity", "model_shapes")
    code = "; ".join([*(f"import noria.protocol.{m}" for m in modules), "import sys",
                      "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"])
    out = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
