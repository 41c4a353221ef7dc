"""`--load-format dummy` (worker/dummy_weights.py): a model from config.json alone, with seeded
random weights made on its device: finite, the same for the same seed, valid quantized tensors
for quantized schemes, the KV cache sized as for the real checkpoint, and an engine that
generates from a folder without a single *.safetensors file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from noria.bench.gpu_checkpoint import TINY, W4A16_CONFIG, build_checkpoint, quantized_variant
from noria.protocol.quant_fp8 import online_quant
from noria.worker.dummy_weights import fill_dummy
from noria.worker.loader import load_model, load_spec
from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.quant_linear import QuantLinear

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dummy")
    config = build_checkpoint(root / "config", TINY, "float32", CPU, 0, weights=False)
    real = build_checkpoint(root / "real", TINY, "float32", CPU, 0)
    w4 = copy.deepcopy(W4A16_CONFIG)
    w4["config_groups"]["group_0"]["weights"]["group_size"] = 32  # the tiny model's 64 features
    return {"config": config, "real": real, "w4a16": quantized_variant(config, root / "w4a16", w4)}


def _state(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """The weights as made, before load_model packs them for the native CPU GEMMs."""
    model = CausalLM(load_spec(path))
    fill_dummy(model, seed)
    return {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}


def test_a_config_only_folder_loads_finite_seeded_weights(folders: dict[str, Path]) -> None:
    assert not list(folders["config"].glob("*.safetensors"))
    a, b, c = _state(folders["config"], 0), _state(folders["config"], 0), _state(folders["config"], 1)
    assert a.keys() == b.keys() == c.keys() and len(a) > 10
    for name, t in a.items():
        assert torch.isfinite(t).all(), name
        assert torch.equal(t, b[name]), name  # same seed, same tensor
    weights = [n for n in a if n.endswith("weight") and "norm" not in n] + ["embed_tokens"]
    assert all(not torch.equal(a[n], c[n]) for n in weights)  # another seed, other values
    assert all(float(a[n].abs().max()) <= 1e-3 for n in weights)  # vLLM's dummy range
    assert all(torch.equal(a[n], torch.ones_like(a[n])) for n in a if n.endswith("norm.weight"))


def test_quantized_schemes_get_valid_quantized_tensors(folders: dict[str, Path]) -> None:
    spec = load_spec(folders["w4a16"])
    assert spec.quantization is not None and spec.quantization.method == "compressed-tensors"
    model = load_model(folders["w4a16"], spec, CPU, torch.float32, load_format="dummy", seed=0)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * TINY["num_hidden_layers"]
    for layer in layers:
        # The torch reference over the tensors the dummy load made: int4 values in range, positive scales.
        q = layer.qweight if not layer.qweight.is_meta else None
        if q is not None:
            assert int(q.min()) >= -8 and int(q.max()) <= 7 and len(q.unique()) > 8
        x = torch.randn(3, layer.in_features)
        assert torch.isfinite(layer(x)).all()
    # Online fp8: float weights made, then quantized at pack time to e4m3 with per-row scales.
    spec8 = online_quant(load_spec(folders["config"]), "fp8")
    model8 = load_model(folders["config"], spec8, CPU, torch.float32, load_format="dummy", seed=0)
    fp8 = [m for m in model8.modules() if isinstance(m, QuantLinear)]
    assert fp8 and all(m.weight.is_meta for m in fp8)  # the float copy is gone
    x = torch.randn(2, TINY["hidden_size"])
    assert all(torch.isfinite(m(x)).all() for m in fp8 if m.in_features == TINY["hidden_size"])


def test_the_engine_serves_a_config_only_folder_and_sizes_its_cache_as_for_the_checkpoint(
        folders: dict[str, Path]) -> None:
    from noria import LLM, SamplingParams
    from noria.protocol.config import EngineConfig
    from noria.worker.model_runner import ModelRunner

    flags = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "seed": 3}
    real = ModelRunner(EngineConfig(model=str(folders["real"]), **flags))
    dummy = ModelRunner(EngineConfig(model=str(folders["real"]), load_format="dummy", **flags))
    assert (dummy.num_kv_blocks, dummy.num_cpu_blocks) == (real.num_kv_blocks, real.num_cpu_blocks)
    assert not torch.equal(dummy.model.embed_tokens, real.model.embed_tokens)  # the random ones, not the file's

    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(str(folders["config"]), load_format="dummy", **flags) as llm:
            [out] = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
            outs.append(out.outputs[0].token_ids)
    assert len(outs[0]) == 5 and outs[0] == outs[1]  # same seed, same weights, same greedy tokens
    with pytest.raises(ValueError, match="no \\*.safetensors"):  # without the flag: refused up front
        LLM(str(folders["config"]), **flags)
