"""FP8 checkpoints end to end on the CPU: compressed-tensors float-quantized, quant_method fp8
with 128 x 128 blocks, and --quantization fp8 of a float checkpoint.

The references: transformers' own loading of the compressed-tensors checkpoints with
CompressedTensorsConfig(dequantize=True), and for the block checkpoints (transformers'
FineGrainedFP8 needs accelerate to load on a CPU, which this environment lacks) a float64
transformers model of the same checkpoint with every block dequantized as q * scale. Where the
CPU computes fp8 layers with float activations (the native kernel's "widen" layout, or the torch
reference), those are the same products as noria's, so every position's logits agree to float32
rounding (atol 5e-5 on logits of magnitude ~5) and the argmax is equal. The "dot" layout
(AVX512_BF16) rounds each fp8 layer's input to bf16: its reference rounds those inputs too (hooks
on the transformers model's quantized linear layers), and as such rounding chained through a
model cannot be compared to float32 rounding, the logits must be nearer to it than the rounding
moves the float reference (tests/quant_checks.py's rule). The GPU kind's arithmetic (e4m3
activations) is checked against compressed-tensors' own activation quantization in
tests/test_worker_gemm_fp8.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol.model_spec import read_spec
from noria.worker import gemm_fp8_kernels, gemm_quant_kernels, native_stack
from noria.worker.models import quant_kinds
from noria.worker.models.quant_linear import QuantLinear
from tests.fp8_checkpoints import (
    dequantized_copy,
    save_block_fp8,
    save_compressed_fp8,
)
from tests.quant_checks import check_logits, prompt_logits
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the test checkpoints")

PROMPT = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]
NATIVE = gemm_fp8_kernels.usable()
# The fp8 layers' descriptors are read by worker/gemm_quant_kernels.py's dispatcher, inside the driver.
NATIVE_STACK = NATIVE and gemm_quant_kernels.usable() and native_stack.load() is not None
# The native kernel rounds the fp8 layers' activations to bf16 (worker/gemm_fp8_kernels.py).
DOT = NATIVE and gemm_fp8_kernels.layout() == "dot"


def _kind(scheme: str) -> str:
    """The CPU kind of an fp8 scheme: the native GEMM where built, else the torch reference."""
    return "native_fp8" if NATIVE else f"torch_{scheme.lower()}"


def _reference(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers model's logits of PROMPT, and where the native kernel rounds its activations
    ("dot"), the logits with every quantized layer's input rounded to bf16 as it does (else None)."""
    with torch.inference_mode():
        plain = model(torch.tensor([PROMPT])).logits[0]
        if not DOT:
            return plain, None
        quantized = [m for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
        assert len(quantized) == 14  # q, k, v, o, gate, up, down in both layers

        def rounded_input(m: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return (args[0].to(torch.bfloat16).to(args[0].dtype), *args[1:])

        hooks = [m.register_forward_pre_hook(rounded_input) for m in quantized]
        try:
            return plain, model(torch.tensor([PROMPT])).logits[0]
        finally:
            for h in hooks:
                h.remove()


def _close(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    plain, rounded = want
    if rounded is None:
        torch.testing.assert_close(got.double(), plain.double(), rtol=0, atol=5e-5)
        assert got.argmax(-1).tolist() == plain.argmax(-1).tolist()
    else:
        check_logits(got.double(), rounded.double(), plain.double())


def _layers(runner: Any) -> list[QuantLinear]:
    return [m for m in runner.model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize(("strategy", "acts", "name"), [("channel", "dynamic", "FP8-dynamic"),
                                                        ("tensor", "static", "FP8-static"),
                                                        ("channel", None, "FP8"),
                                                        ("tensor", "dynamic", "FP8-dynamic"),
                                                        ("block", "dynamic", "FP8-dynamic")])
def test_compressed_tensors_fp8_matches_transformers_dequantized(tmp_path, strategy, acts, name):
    from transformers import CompressedTensorsConfig

    path = save_compressed_fp8(tmp_path / "m", strategy, acts)
    logits, runner = prompt_logits(path, PROMPT)
    layers = _layers(runner)
    assert len(layers) == 8  # qkv, o, gate_up, down in both layers; lm_head ignored
    assert {m.op.kind for m in layers} == {_kind(name)}
    assert {m.scheme.name for m in layers} == {name}
    line = quant_kinds.describe(runner.model, runner.spec.quantization.describe)
    group = " g128" if strategy == "block" else ""
    assert line.startswith(f"quantized weights: compressed-tensors {name}{group}; kinds: ")
    if acts == "static":  # kept for the GPU kind: the largest of the fused parts' scales
        qkv = runner.model.layers[0].self_attn.qkv_proj
        assert qkv.input_scale.shape == (qkv.out_features, 1) and bool((qkv.input_scale > 0).all())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    _close(logits, _reference(model))


def _block_reference(path: Path, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dequantized_copy(path, tmp_path / "ref")),
                                                 dtype=torch.float64).eval()
    return _reference(model)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_block_fp8_matches_the_dequantized_model(tmp_path, arch):
    from noria.worker import native_coverage

    path = save_block_fp8(tmp_path / "m", arch)
    logits, runner = prompt_logits(path, PROMPT)
    layers = _layers(runner)
    assert len(layers) == 8 and {(m.group, m.op.kind) for m in layers} == {(128, _kind("FP8-dynamic"))}
    assert runner.spec.quantization.describe == "fp8 FP8-dynamic g128"
    _close(logits, _block_reference(path, tmp_path))
    # The native decoder stack runs every layer where the fp8 GEMM is built (its descriptor).
    reasons = native_coverage.coverage(runner.model, runner._kv_layers)
    assert reasons == [None, None] if NATIVE_STACK else all(reasons)


def test_per_tensor_fp8_with_static_activations_matches_the_dequantized_model(tmp_path):
    path = save_block_fp8(tmp_path / "m", per_tensor=True)
    logits, runner = prompt_logits(path, PROMPT)
    layers = _layers(runner)
    assert {(m.group, m.scheme.name) for m in layers} == {(m.in_features, "FP8-static") for m in layers}
    _close(logits, _block_reference(path, tmp_path))


def test_block_scales_cover_their_rows_in_fused_parts(tmp_path):
    # k_proj and v_proj hold 32 rows each, a part of one block of rows: their scales land on their
    # own rows of the fused layer, and gate/up's three row blocks on theirs.
    from safetensors import safe_open

    path = save_block_fp8(tmp_path / "m")
    _, runner = prompt_logits(path, PROMPT)
    qkv = runner.model.layers[1].self_attn.qkv_proj
    packed = qkv.op.packed if NATIVE else None
    scale = packed.unpack()[1] if packed is not None else qkv.weight_scale.data
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        parts = [f.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight_scale_inv") for p in "qkv"]
    want = torch.cat([p.repeat_interleave(128, 0)[:rows] for p, rows in zip(parts, (128, 32, 32), strict=True)])
    assert torch.equal(scale, want)


def test_tensor_parallel_ranks_cut_blocks_by_rows_and_whole_groups(tmp_path):
    # Two ranks: each holds half of every column-parallel layer's expanded rows (q/k/v 128 of 256,
    # gate/up 256 of 512) and half of o_proj's and down_proj's input features, whole groups of 128.
    from tests.test_worker_tp import _drive, _run_ranks
    from tests.test_worker_tp import _runner as _tp_runner

    path = save_block_fp8(tmp_path / "m", "llama", hidden_size=256, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=512)
    single, single_logits = _drive(_tp_runner(str(path), 1), 512)
    ranks = _run_ranks(path, 2, 512, tmp_path)
    assert [r["outputs"] for r in ranks] == [single, single]
    for a, b in zip(ranks[0]["logits"], single_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_online_fp8_quantizes_every_linear_layer_but_the_lm_head(tmp_path, demo_path):
    # Per-channel e4m3 at load: each row of the float weight by its own max |w| / 448. The model
    # it gives is the float model with those weights, and the engine serves it.
    from noria.protocol.config import EngineConfig
    from noria.worker.model_runner import ModelRunner
    from noria.worker.models.quant_fp8 import quantize_rows_fp8

    path = make_checkpoint("qwen2", tmp_path / "float", hidden_size=128, intermediate_size=256)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64,
                                      swap_space=0.001, num_threads=2, quantization="fp8"))
    layers = _layers(runner)
    assert len(layers) == 8 and {m.scheme.layout for m in layers} == {"online"}
    assert not isinstance(runner.model.lm_head, QuantLinear) and runner.model.embed_tokens.dtype == torch.float32
    assert {m.op.kind for m in layers} == {_kind("FP8-dynamic")}
    assert quant_kinds.describe(runner.model, runner.spec.quantization.describe).startswith(
        "quantized weights: fp8 online per-channel; kinds: ")
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    w = weights["model.layers.0.mlp.down_proj.weight"]
    q, s = quantize_rows_fp8(w)
    down = runner.model.layers[0].mlp.down_proj
    got_q, got_s = down.op.packed.unpack() if NATIVE else (down.qweight, down.weight_scale)
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    assert float((q.float() * s - w).abs().max()) <= float(w.abs().max()) / 16  # e4m3: 3 mantissa bits

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=64, quantization="fp8") as llm:
        out = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.skipif(not NATIVE_STACK, reason="no C compiler for the native kernels")
@pytest.mark.parametrize("case", ["per-channel", "128 x 128 blocks", "online"])
def test_the_native_stack_runs_fp8_layers_as_the_python_path_does(tmp_path, case):
    # The driver calls each layer's fp8 GEMM through its descriptor (gemm_quant.c's "any" entry,
    # which calls gemm_fp8.c's kernel): the same kernel on the same rows, so the same bits, the
    # hidden states and the KV they write, whatever the step's shape.
    from noria.protocol.config import EngineConfig
    from noria.worker import native_coverage
    from noria.worker.model_runner import ModelRunner
    from tests.test_worker_native_stack import STEPS, _forward

    if case == "online":
        path = make_checkpoint("qwen2", tmp_path / "float", hidden_size=128, intermediate_size=256)
        runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=128,
                                          swap_space=0.001, num_threads=2, quantization="fp8"))
    elif case == "per-channel":
        runner = prompt_logits(save_compressed_fp8(tmp_path / "m", "channel", "dynamic"), PROMPT)[1]
    else:
        runner = prompt_logits(save_block_fp8(tmp_path / "m", "qwen3"), PROMPT)[1]
    layers = _layers(runner)
    groups = {m.group == 128 if case.startswith("128") else m.group == m.in_features for m in layers}
    assert len(layers) == 8 and {m.op.kind for m in layers} == {"native_fp8"} and groups == {True}
    assert native_coverage.coverage(runner.model, runner._kv_layers) == [None, None]
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)
    stack = runner.model._stack
    before = 0 if stack is None else stack.layer_runs  # prompt_logits' prefill may have run there
    for name, step in STEPS.items():
        native, ran = _forward(runner, step, native=True)
        python, ran_python = _forward(runner, step, native=False)
        assert ran == (name != "long prompt") and not ran_python, name  # a long prompt's SDPA: Python
        assert torch.equal(native, python), f"{case}, {name}: hidden states or written K/V differ"
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, 2, True)] and stack.layer_runs - before == 3 * 2


def test_online_fp8_of_a_quantized_checkpoint_is_refused(tmp_path, demo_path):
    path = save_block_fp8(tmp_path / "m")
    words = r"--quantization fp8 quantizes a float checkpoint at load, and this one is quantized already"
    from noria.protocol.config import EngineConfig
    from noria.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match=words):
        ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=16,
                                 swap_space=0.001, quantization="fp8"))
    with pytest.raises(ValueError, match=words), LLM(str(path), tokenizer=str(demo_path), dtype="float32",
                                                    num_kv_blocks=16, quantization="fp8"):
        pass


def _with_config(tmp_path: Path, quant: dict[str, Any]) -> Path:
    path = save_block_fp8(tmp_path / "base")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _ct(weights: dict[str, Any], acts: dict[str, Any] | None = None, fmt: str = "float-quantized") -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


F8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(("quant", "words"), [
    (_ct({**F8, "num_bits": 4, "strategy": "tensor_group", "group_size": 16}, fmt="nvfp4-pack-quantized"),
     "4-bit float weights (nvfp4-pack-quantized)"),
    ({**FP8, "fmt": "e5m2"}, "fp8 e5m2 weights are not supported"),
    ({**FP8, "weight_block_size": [128, 64]}, "fp8 weight_block_size [128, 64] is not supported"),
    ({**FP8, "activation_scheme": "static"}, "block-scaled weights with static activation scales"),
    (_ct(F8, {**F8, "strategy": "tensor", "dynamic": True}), "fp8 activations (tensor strategy, dynamic True)"),
    (_ct({**F8, "dynamic": True}), "dynamic weight quantization"),
    (_ct(F8, {**F8, "type": "int"}), "activations quantized as"),
])
def test_unsupported_fp8_variants_are_refused_before_any_weight_is_read(tmp_path, quant, words):
    path = _with_config(tmp_path, quant)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_spec(path)


def _rewrite(path: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensor
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("name", "tensor", "words"), [
    ("model.layers.0.mlp.up_proj.weight_scale_inv", torch.ones(2, 2), r"has shape \(2, 2\), expected \(3, 2\)"),
    ("model.layers.1.self_attn.o_proj.weight", torch.zeros(256, 128, dtype=torch.float8_e5m2),
     "is torch.float8_e5m2, expected float8_e4m3fn"),
    ("model.layers.0.self_attn.k_proj.weight_scale_inv", torch.ones(1, 2, dtype=torch.int32),
     "expected floating-point scales"),
])
def test_bad_tensors_are_refused_by_name(tmp_path, name, tensor, words):
    path = save_block_fp8(tmp_path / "m")
    _rewrite(path, name, tensor)
    with pytest.raises(ValueError, match=f"{name!r}.*{words}" if "shape" in words else words):
        prompt_logits(path, PROMPT)


def test_a_wrong_per_channel_scale_is_refused_by_name(tmp_path):
    path = save_compressed_fp8(tmp_path / "m", "channel", "dynamic")
    _rewrite(path, "model.layers.0.mlp.down_proj.weight_scale", torch.ones(128, 2))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight_scale' has shape \(128, 2\), "
                                         r"expected one scale or one per output row \(128\)"):
        prompt_logits(path, PROMPT)
