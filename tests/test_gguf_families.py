"""What a GGUF file's metadata says beyond what transformers' config reading takes from it, as
llama.cpp reads it (protocol/gguf_config.py): Llama 3's rope_freqs, linear and YaRN rope scaling
(Gemma 3's on its global layers), Gemma 2's soft-caps and Gemma's attention scale.

The reference for each file is transformers' GGUF loading of its weights (dequantized, as in
tests/test_gguf.py) into the model the file was converted from, with that model's own config:
transformers' config of the file would drop what is tested here. Each test also shows that the
difference matters: the logits of transformers' config of the file are far off. Tolerance:
float32 rounding (atol 2e-5 on logits of magnitude ~1), as every weight is the same exact product.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from noria.frontend.gguf_view import gguf_view
from noria.protocol import gguf_file, switches
from noria.protocol.checkpoint import CheckpointError
from noria.protocol.gguf_config import llama3_factors, metadata_config
from tests import gguf_files as gf
from tests.quant_checks import prompt_logits
from tests.test_gguf import PROMPT


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(switches.CPU_W4A16, "1")


@pytest.fixture(scope="module")
def vocab(demo_path: Path) -> int:
    return len(json.loads((demo_path / "tokenizer.json").read_text())["model"]["vocab"])


def _check(path: Path, config: Any) -> dict[str, Any]:
    """noria's logits of the file against the converted model's; returns the view's config."""
    view = gguf_view(path)
    logits, _ = prompt_logits(view, PROMPT, 64)
    with torch.inference_mode():
        want = gf.reference(path, config)(torch.tensor([PROMPT])).logits[0]
        dropped = gf.reference(path)(torch.tensor([PROMPT])).logits[0]  # transformers' config of the file
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=2e-5)
    assert (dropped - want).abs().max() > 1e-2, "the metadata under test does not change this model"
    return json.loads((view / "config.json").read_text())


def _rope_freqs(factors: np.ndarray) -> Any:
    return lambda w: w.add_tensor("rope_freqs.weight", factors.astype(np.float32))


def _converter_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf writes into rope_freqs for a llama3 rope_scaling."""
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    return llama3_factors(inv.astype(np.float64), rope["factor"], rope["low_freq_factor"],
                          rope["high_freq_factor"], rope["original_max_position_embeddings"])


@pytest.mark.parametrize("types", ["F32", "Q4_K_M"])
def test_llama_3s_rope_freqs_are_its_rope_scaling(tmp_path, types, vocab, demo_path):
    # tests/tiny_models.py's llama3: original context 64, so that some of the tiny heads'
    # frequencies are slowed and some blended (the standard 8192 would slow them all).
    model = gf.tiny_model("llama3", vocab)
    rope = dict(model.config.rope_parameters)
    rule = gf.q4_k_m if types == "Q4_K_M" else gf.every("F32")
    path = gf.write_gguf(model, tmp_path / "m.gguf", "llama", rule, demo_path,
                         metadata=_rope_freqs(_converter_factors(rope, 64)))
    got = _check(path, model.config)["rope_parameters"]
    assert got["rope_type"] == "llama3" and got["original_max_position_embeddings"] == 64
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert got[key] == pytest.approx(rope[key], rel=1e-4), key


def test_llama_3_1s_own_rope_freqs_give_its_parameters_exactly(tmp_path, vocab, demo_path):
    # Llama 3.1 / 3.2 / 3.3: factor 8 (32 for 3.2), low 1, high 4, original context 8192, theta 5e5.
    rope = {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    path = gf.write_gguf(gf.tiny_model("llama", vocab), tmp_path / "m.gguf", "llama", gf.every("Q8_0"),
                         demo_path, metadata=_rope_freqs(_converter_factors(rope, 64)))
    reader = gguf_file.open_gguf(path)
    cfg = metadata_config(reader, "llama", {"head_dim": 64, "rope_parameters": {"rope_theta": 500000.0}}, path)
    assert cfg["rope_parameters"] == {**rope, "rope_type": "llama3"}


def test_rope_freqs_that_are_not_llama_3s_are_refused(tmp_path, vocab, demo_path):
    factors = np.linspace(1.0, 3.0, 32)[::-1].copy()  # slows the fast frequencies: no Llama 3 rope
    path = gf.write_gguf(gf.tiny_model("llama", vocab), tmp_path / "m.gguf", "llama", gf.every("Q8_0"),
                         demo_path, metadata=_rope_freqs(factors))
    with pytest.raises(CheckpointError, match="its rope_freqs tensor .* does not follow Llama 3's rope scaling"):
        gguf_view(path)


def test_gemma_3s_linear_rope_scaling_applies_to_its_global_layers(tmp_path, vocab, demo_path):
    # Gemma 3 4B and up: linear scaling (factor 8) on the global layers, which llama.cpp reads
    # from gemma3.rope.scaling.*; six layers, so that the sixth is global (llama.cpp's pattern).
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    model = gf.tiny_model("gemma3", vocab, num_hidden_layers=6, sliding_window=4, rope_parameters=rope)

    def scaling(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(gf_rope_type("linear"))
        w.add_rope_scaling_factor(8.0)

    path = gf.write_gguf(model, tmp_path / "m.gguf", "gemma3", gf.q4_k_m, demo_path, metadata=scaling)
    got = _check(path, model.config)["rope_parameters"]
    assert got["full_attention"]["factor"] == 8.0 and got["sliding_attention"]["rope_type"] == "default"


def test_qwen2s_yarn_rope_scaling_is_read(tmp_path, vocab, demo_path):
    # Qwen2.5's long-context files: YaRN, factor 4 over an original context (here 8 tokens, so
    # the tiny prompt reaches past it).
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
    model = gf.tiny_model("qwen2", vocab, rope_parameters=rope)

    def scaling(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(gf_rope_type("yarn"))
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(8)

    path = gf.write_gguf(model, tmp_path / "m.gguf", "qwen2", gf.every("Q8_0"), demo_path, metadata=scaling)
    got = _check(path, model.config)["rope_parameters"]
    assert (got["rope_type"], got["factor"], got["original_max_position_embeddings"]) == ("yarn", 4.0, 8)


def test_a_rope_scaling_noria_does_not_apply_is_refused(tmp_path, vocab, demo_path):
    def scaling(w: GGUFWriter) -> None:
        w.add_string("qwen2.rope.scaling.type", "longrope")
        w.add_rope_scaling_factor(4.0)

    path = gf.write_gguf(gf.tiny_model("qwen2", vocab), tmp_path / "m.gguf", "qwen2", gf.every("Q8_0"), demo_path,
                         metadata=scaling)
    with pytest.raises(CheckpointError, match="asks for rope scaling 'longrope'"):
        gguf_view(path)


def test_gemma_2s_soft_caps_and_scale_are_the_metadatas(tmp_path, vocab, demo_path):
    # tests/gguf_files.py's Gemma 2: caps 20 and 5 (not transformers' 50 and 30), and
    # 1 / sqrt(head_dim 64) (not transformers' 1 / sqrt(256)).
    model = gf.tiny_model("gemma2", vocab, tied=True)
    path = gf.write_gguf(model, tmp_path / "m.gguf", "gemma2", gf.every("Q8_0"), demo_path)
    cfg = _check(path, model.config)
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"], cfg["query_pre_attn_scalar"]) == \
        (20.0, 5.0, 64)


@pytest.mark.parametrize(("arch", "layers", "scalar"), [("gemma2", 46, 144), ("gemma2", 42, 256),
                                                         ("gemma3", 62, 168), ("gemma3", 48, 256)])
def test_gemmas_attention_scale_is_llama_cpps(tmp_path, arch, layers, scalar):
    # GGUF stores no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models
    # (46 layers for Gemma 2, 62 for Gemma 3) and head_dim for the others, as their configs have.
    hidden, heads = (4608, 32) if layers == 46 else (5376, 32) if layers == 62 else (3584, 16)
    w = GGUFWriter(str(tmp_path / "h.gguf"), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf_file.open_gguf(tmp_path / "h.gguf")
    cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
           "head_dim": 128 if layers in (46, 62) else 256}
    assert metadata_config(reader, arch, cfg, "h.gguf")["query_pre_attn_scalar"] == scalar


def gf_rope_type(name: str) -> Any:
    from gguf import RopeScalingType

    return RopeScalingType(name)


def test_the_converter_factors_are_llama_cpps_formula():
    # llama.cpp's loop (convert_hf_to_gguf), element by element, against the vectorized one.
    rope = {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    got = _converter_factors(rope, 128)
    for i, freq in enumerate(1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            want = 1.0
        elif wavelen > 8192 / 1:
            want = 8.0
        else:
            smooth = (8192 / wavelen - 1) / 3
            want = 1 / ((1 - smooth) / 8 + smooth)
        assert got[i] == pytest.approx(want, rel=1e-6)
