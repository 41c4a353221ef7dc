"""compressed-tensors checkpoints (what llm-compressor writes): int8 W8A8, W8A16 and W4A16.

The checkpoints are made here by compressed-tensors itself (its quantization config applied
to a seeded transformers model, scales from each weight's range, its compressor packing and
saving), and the reference is transformers' own loading of the same files, which decompresses
them into float weights. Weight-only schemes compute the same products in float32, so every
position's logits agree to float32 rounding and greedy decoding is identical. transformers
runs W8A8 with float activations; the reference here adds vLLM's dynamic per-token int8
quantization of every quantized layer's input (a forward pre-hook), which is what noria
computes, so the logits agree to float32 rounding there too (an activation on a rounding tie
may round the other way: hence a tolerance, not equality).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from noria import LLM, SamplingParams
from noria.bench.quantized_models import save_quantized
from noria.protocol import switches
from noria.protocol.model_spec import read_spec
from noria.worker import gemm_quant_kernels
from noria.worker.model_runner import ModelRunner
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp, unpack_words
from tests.quant_checks import check_layers_on_their_inputs, check_logits, fake_quant, prompt_logits
from tests.test_worker_tp import _drive, _run_ranks
from tests.test_worker_tp import _runner as _tp_runner
from tests.tiny_models import make_model

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the test checkpoints")

# hidden 128, intermediate 256: groups of 32 and 64 divide every layer.
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def make_quantized(path: Path, scheme: str, arch: str = "llama", ignore: tuple[str, ...] = ("lm_head",),
                   **overrides: Any) -> Path:
    """A tiny seeded checkpoint quantized and saved by compressed-tensors."""
    return save_quantized(make_model(arch, **{**SIZES, **overrides}), path, scheme, ignore)


def reference(path: Path, act_group: int | None) -> Any:
    """transformers' decompressed model, its quantized layers' inputs rounded to int8 as noria's
    kind rounds them: `act_group` 0 per token (W8A8, vLLM's rule), g per group of g features
    (4-bit weights on int8 activations), None not at all."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    model.generation_config.eos_token_id = None
    ignored = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    if act_group is not None:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in ignored:
                module.register_forward_pre_hook(lambda m, args: (fake_quant(args[0], act_group),))
    return model


def arithmetic(scheme: str) -> tuple[str, int | None]:
    """The kind noria's CPU takes for a scheme (native where built) and how it rounds activations."""
    native = gemm_quant_kernels.usable()
    if scheme == "w8a8":
        return ("packed_w8a8" if native else "torch_w8a8"), 0
    if scheme == "w8a16":  # per channel: a group is a whole row, so the activations round per token
        if native and not switches.cpu_w4a16():
            return "packed_w8a8g", 0
        return ("packed_w8a16" if native else "torch_w8a16"), None
    if native and not switches.cpu_w4a16():
        return "packed_w4a8", int(scheme.split("_g")[1].split("_")[0])
    return ("packed_w4a16" if native else "torch_w4a16"), None


PROMPT = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]


def _logits(path: Path) -> tuple[torch.Tensor, ModelRunner]:
    return prompt_logits(path, PROMPT)


@pytest.mark.parametrize(("scheme", "w4a16"), [("w4a16_g32", False), ("w4a16_g64_asym", False),
                                               ("w4a16_g64_asym", True), ("w8a16", False), ("w8a16", True),
                                               ("w8a8", False)])
def test_every_position_matches_transformers_on_the_decompressed_checkpoint(tmp_path, monkeypatch, scheme, w4a16):
    # Float activations: the reference's products, to float32 rounding. Activations rounded to
    # int8: every layer on its own inputs, and the logits within the rounding's own reach
    # (tests/quant_checks.py says why a chained comparison can be no tighter).
    if w4a16:
        monkeypatch.setenv(switches.CPU_W4A16, "1")
    path = make_quantized(tmp_path / scheme, scheme)
    logits, runner = _logits(path)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 2 * 2  # qkv, o, gate_up, down in both layers; lm_head ignored
    kind, act_group = arithmetic(scheme)
    assert {m.op.kind for m in layers} == {kind}
    with torch.inference_mode():
        plain = reference(path, None)(torch.tensor([PROMPT])).logits[0]
        if act_group is None:
            torch.testing.assert_close(logits, plain, rtol=0, atol=2e-5)
            assert logits.argmax(-1).tolist() == plain.argmax(-1).tolist()
            return
        hooked = reference(path, act_group)(torch.tensor([PROMPT])).logits[0]
    if kind.startswith("packed_"):
        assert check_layers_on_their_inputs(runner, PROMPT) == len(layers)
    check_logits(logits, hooked, plain)


@pytest.mark.parametrize("scheme", ["w4a16_g64_asym", "w8a8"])
def test_the_engine_decodes_greedy_as_one_process_does(tmp_path, scheme, demo_path):
    # The served engine (its processes, scheduler, chunked prefill, batches of other rows) gives
    # the tokens a single ModelRunner gives on its own: each row's int8 rounding is its own, so
    # the kernels' bits do not depend on the batch. That runner is checked against transformers
    # above.
    from tests.test_worker_parity import Driver, Req

    path = make_quantized(tmp_path / scheme, scheme, arch="qwen2")  # q/k/v biases beside quantized weights
    _, runner = _logits(path)
    driver = Driver(runner, token_budget=8)
    for i, prompt in enumerate([PROMPT, PROMPT[:5]]):
        driver.add(Req(i, list(prompt), len(prompt), 12, arrival=0))
    want = driver.run()
    with LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
             max_num_batched_tokens=8) as llm:
        out = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [want[0], want[1]]


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("scheme", ["w4a16_g64_asym", "w8a16", "w8a8"])
def test_the_native_kinds_compute_what_the_torch_reference_does(tmp_path, monkeypatch, scheme):
    # W8A8's int32 sums are exact in both and scaled in the same order: equal bits. Weight-only
    # kinds apply a group's scale to its sum (the reference to each weight): float32 rounding.
    # (4-bit weights on int8 activations: tests/test_worker_gemm_quant.py, against float64.)
    monkeypatch.setenv(switches.CPU_W4A16, "1")
    _, runner = _logits(make_quantized(tmp_path / scheme, scheme))
    g = torch.Generator().manual_seed(1)
    for m in [m for m in runner.model.modules() if isinstance(m, QuantLinear)][:4]:
        x = torch.randn(9, m.in_features, generator=g)
        q, s, z = m.op.packed.unpack() if scheme != "w8a8" else (*m.op.packed.unpack(), None)
        ref = QuantLinear(m.in_features, m.out_features, m.bias is not None, m.scheme)
        ref.qweight.data, ref.weight_zero = q, None if z is None else torch.nn.Parameter(z, requires_grad=False)
        ref.weight_scale.data = s.reshape(m.out_features, -1)
        ref.bias = m.bias
        want = TorchQuantOp(ref)(x, m.bias)
        if scheme == "w8a8":
            assert torch.equal(m.op(x, m.bias), want)
        else:
            torch.testing.assert_close(m.op(x, m.bias), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16_g32", "w8a16"])
def test_the_native_stack_runs_quantized_layers_as_the_python_path_does(tmp_path, scheme):
    # The driver calls each layer's kind through its descriptor entry: the same kernels on the
    # same rows, so the same bits, hidden states and the KV it writes.
    from noria.worker import native_coverage
    from tests.test_worker_native_stack import STEPS, _forward

    _, runner = _logits(make_quantized(tmp_path / scheme, scheme))
    assert native_coverage.coverage(runner.model, runner._kv_layers) == [None, None]
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)
    for name, step in STEPS.items():
        native, ran = _forward(runner, step, native=True)
        python, ran_python = _forward(runner, step, native=False)
        assert ran == (name != "long prompt") and not ran_python, name  # a long prompt's SDPA: Python
        assert torch.equal(native, python), name


def test_tensor_parallel_ranks_take_their_groups_with_their_columns(tmp_path):
    # Row-parallel o_proj and down_proj: each rank holds a slice of the input features and the
    # scales and zero points of the groups in it (64 and 128 features per rank, groups of 64).
    path = make_quantized(tmp_path / "m", "w4a16_g64_asym")
    single, single_logits = _drive(_tp_runner(str(path), 1), 512)
    ranks = _run_ranks(path, 2, 512, tmp_path)
    assert [r["outputs"] for r in ranks] == [single, single]
    for a, b in zip(ranks[0]["logits"], single_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_quantized_lm_head_and_a_layer_left_in_float(tmp_path):
    # Only the first layer's MLP down_proj is ignored; the lm_head is quantized with the rest.
    path = make_quantized(tmp_path / "m", "w4a16_g32", ignore=("model.layers.0.mlp.down_proj",))
    logits, runner = _logits(path)
    model = runner.model
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    assert check_layers_on_their_inputs(runner, PROMPT) == (8 if gemm_quant_kernels.usable() else 0)
    with torch.inference_mode():
        plain = reference(path, None)(torch.tensor([PROMPT])).logits[0]
        hooked = reference(path, arithmetic("w4a16_g32")[1])(torch.tensor([PROMPT])).logits[0]
    check_logits(logits, hooked, plain)


def test_the_spec_reads_the_schemes(tmp_path):
    spec = read_spec(make_quantized(tmp_path / "m", "w4a16_g64_asym"))
    q = spec.quantization
    assert q is not None and q.method == "compressed-tensors"
    s = q.scheme_for("model.layers.1.self_attn.k_proj")
    assert s is not None and (s.bits, s.group, s.symmetric, s.packed, s.act_int8) == (4, 64, False, True, False)
    assert q.scheme_for("lm_head") is None
    s8 = read_spec(make_quantized(tmp_path / "w8a8", "w8a8")).quantization.scheme_for("model.layers.0.mlp.up_proj")
    assert (s8.bits, s8.group, s8.packed, s8.act_int8) == (8, None, False, True)


def _config_with(tmp_path: Path, quant: dict[str, Any], **extra: Any) -> Path:
    path = make_quantized(tmp_path / "base", "w8a8")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    cfg.update(extra)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _group(weights: dict[str, Any], fmt: str, acts: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


W8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}


@pytest.mark.parametrize(("quant", "words"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes' is not supported yet"),
    # FP8 is loaded (tests/test_quant_fp8.py); 4-bit floats (NVFP4) are not.
    (_group({**W8, "type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16},
            "nvfp4-pack-quantized"), "4-bit float weights (nvfp4-pack-quantized)"),
    (_group({**W8, "num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "group"}, "pack-quantized"),
     "actorder 'group'"),
    (_group(W8, "int-quantized", {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}),
     "noria computes dynamic per-token symmetric int8"),
    ({**_group(W8, "int-quantized"), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_what_is_not_computed_is_refused_before_any_weight_is_read(tmp_path, quant, words, demo_path):
    path = _config_with(tmp_path, quant)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_spec(path)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")), \
            LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=16):
        pass


def test_fused_parts_quantized_differently_are_refused(tmp_path):
    path = make_quantized(tmp_path / "m", "w8a8", ignore=("lm_head", "model.layers.0.self_attn.k_proj"))
    with pytest.raises(ValueError, match="quantized differently.*k_proj: float"):
        _logits(path)


def test_unpacking_is_compressed_tensors_packing_undone():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        lo = -(1 << (bits - 1))
        values = torch.randint(lo, -lo, (24, 40), generator=g, dtype=torch.int8)
        assert torch.equal(unpack_words(pack_to_int32(values, bits, packed_dim=1), bits, 40, 1), values)
        assert torch.equal(unpack_words(pack_to_int32(values, bits, packed_dim=0), bits, 24, 0), values)
