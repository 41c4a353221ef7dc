"""Quantized mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): compressed-tensors
W4A16 / W8A16 / W8A8 / FP8, quant_method fp8 blocks, AWQ and GPTQ experts, online fp8.

The checkpoints are made by the real tools where there is one (compressed-tensors' lifecycle
over the checkpoint's per-expert modules, tests/moe_quant_files.py) and by the formats' packers
otherwise. References: transformers' own loading of the compressed-tensors checkpoints
(CompressedTensorsConfig(dequantize=True)), and a float64 transformers model of the dequantized
weights for the formats transformers cannot load on a CPU. With float activations (the FP8 CPU
kinds, and the 4/8-bit weight-only ones under NORIA_CPU_W4A16) noria computes the same products,
so every position's logits agree to float32 rounding, with the dense tests' tolerances
(tests/test_quant_compressed_tensors.py, test_quant_fp8.py, test_quant_awq_gptq.py). Kinds
that round activations to int8 are checked layer by layer on their own inputs, experts included
(tests/quant_checks.py says why a chained comparison can be no tighter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol import switches
from noria.protocol.checkpoint import CheckpointError, check_checkpoint
from noria.protocol.model_spec import model_spec, read_spec
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.quant_linear import QuantLinear
from tests import awq_gptq_files as hand
from tests.moe_quant_files import reference_logits, save_awq_gptq, save_compressed, save_fp8_blocks
from tests.quant_checks import check_layers_on_their_inputs, prompt_logits, rounds_activations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the test checkpoints")

PROMPT = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _blocks(runner: Any) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _experts_stay_quantized(runner: Any) -> set[str]:
    """Every sparse layer's experts are quantized layers, no float copy of them is kept (the
    stacked float experts hold a shape only); returns the experts' kinds."""
    kinds = set()
    for block in _blocks(runner):
        assert block.quantized is not None and block.experts_gate_up.is_meta and block.experts_down.is_meta
        layers = [*block.quantized.gate_up, *block.quantized.down]
        assert len(layers) == 2 * block.num_experts and all(isinstance(m, QuantLinear) for m in layers)
        kinds |= {m.op.kind for m in layers}
        assert not block.router.is_meta and block.router.dtype == torch.float32  # the router stays float
    return kinds


def _transformers(path: Path) -> torch.Tensor:
    from transformers import CompressedTensorsConfig

    from tests.fp8_checkpoints import transformers_logits

    return transformers_logits(path, PROMPT, quantization_config=CompressedTensorsConfig(dequantize=True))


@pytest.mark.parametrize(("arch", "scheme", "kind", "atol"), [
    ("qwen3_moe", "w4a16_g32", "packed_w4a16", 2e-5),
    ("mixtral", "w8a16", "packed_w8a16", 2e-5),
    ("qwen2_moe", "w4a16_g64_asym", "packed_w4a16", 2e-5),  # the shared expert quantized like the experts
    ("qwen3_moe", "fp8", "native_fp8", 5e-5),
])
def test_compressed_tensors_experts_match_transformers(tmp_path, monkeypatch, arch, scheme, kind, atol):
    from noria.worker import gemm_fp8_kernels, gemm_quant_kernels

    native = gemm_fp8_kernels.usable() if scheme == "fp8" else gemm_quant_kernels.usable()
    monkeypatch.setenv(switches.CPU_W4A16, "1")  # float activations: the reference's products
    path, decompressed = save_compressed(arch, tmp_path / "m", scheme)
    logits, runner = prompt_logits(path, PROMPT)
    kinds = _experts_stay_quantized(runner)
    assert kinds == {kind if native else f"torch_{runner.spec.quantization.groups[0][1].name.lower()}"}
    if arch == "qwen2_moe":
        block = _blocks(runner)[0]
        assert isinstance(block.shared_gate_up, QuantLinear) and isinstance(block.shared_down, QuantLinear)
    # transformers' loader drops the zero points of experts it fuses: compressed-tensors' own
    # decompressor reads the asymmetric checkpoint instead (a float64 model of its weights).
    want = reference_logits(decompressed, PROMPT) if "asym" in scheme else _transformers(path)
    _close_or_rounded(runner, logits, want, atol)


def _close_or_rounded(runner: Any, logits: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Float activations: the reference's products, to float32 rounding. The fp8 "dot" layout
    rounds each fp8 layer's input to bf16: every layer, experts included, checked on its own
    inputs instead, and the logits near the float reference (tests/quant_checks.py says why a
    chained comparison can be no tighter)."""
    if not any(rounds_activations(m) for m in runner.model.modules() if isinstance(m, QuantLinear)):
        torch.testing.assert_close(logits.double(), want.double(), rtol=0, atol=atol)
        assert logits.argmax(-1).tolist() == want.argmax(-1).tolist()
        return
    assert check_layers_on_their_inputs(runner, _routed_everywhere(runner)) > 0
    want = want.float()
    assert (logits - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16_g32"])
def test_int8_activation_kinds_compute_every_expert_on_its_own_inputs(tmp_path, scheme):
    # W8A8 (int8 per token) and the default 4-bit kind (int8 per group): each layer, every
    # expert included, against float64 products of its rounded inputs; the logits near the
    # float-activation ones of the decompressed weights.
    from noria.worker import gemm_quant_kernels

    if not gemm_quant_kernels.usable():
        pytest.skip("no C compiler for the native kernels")
    path, decompressed = save_compressed("qwen3_moe", tmp_path / "m", scheme)
    logits, runner = prompt_logits(path, PROMPT)
    _experts_stay_quantized(runner)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    active = {id(m) for b in _blocks(runner) for m in [*b.quantized.gate_up, *b.quantized.down]}
    checked = check_layers_on_their_inputs(runner, _routed_everywhere(runner))
    assert checked == len(layers) and len(active) == 2 * 8  # one sparse layer of 8 experts
    # (transformers' loader cannot fuse int-quantized experts: compressed-tensors' decompressor reads them)
    want = reference_logits(decompressed, PROMPT).float()
    assert (logits - want).abs().max() < 0.05 * want.abs().max()


def _routed_everywhere(runner: Any) -> list[int]:
    """A prompt long enough that every expert of the tiny model gets rows (the check reads each
    layer's inputs, so an expert no token chose would have none)."""
    return list(range(3, 259))


def test_fp8_blocks_as_fp8_qwen3_moe_ships_match_the_dequantized_model(tmp_path):
    path, plain = save_fp8_blocks("qwen3_moe", tmp_path / "m")
    logits, runner = prompt_logits(path, PROMPT)
    kinds = _experts_stay_quantized(runner)
    from noria.worker import gemm_fp8_kernels

    assert kinds == {"native_fp8" if gemm_fp8_kernels.usable() else "torch_fp8-dynamic"}
    assert {m.group for b in _blocks(runner) for m in b.quantized.gate_up} == {128}
    assert runner.spec.quantization.describe == "fp8 FP8-dynamic g128"
    _close_or_rounded(runner, logits, reference_logits(plain, PROMPT), 5e-5)


@pytest.mark.parametrize(("arch", "variant"), [("mixtral", hand.Variant("awq", group=32)),
                                               ("qwen2_moe", hand.Variant("gptq", group=32, desc_act=True)),
                                               ("qwen3_moe", hand.Variant("gptq", bits=8, group=-1, fmt="gptq_v2"))],
                         ids=["awq-mixtral", "gptq4-desc_act-qwen2_moe", "gptq8-channel-qwen3_moe"])
def test_awq_and_gptq_experts_match_the_dequantized_model(tmp_path, monkeypatch, arch, variant):
    # The per-expert modules AutoAWQ and GPTQModel write (block_sparse_moe.experts.E.w1 for
    # Mixtral), GPTQ's activation order per expert included.
    monkeypatch.setenv(switches.CPU_W4A16, "1")
    path, plain = save_awq_gptq(arch, tmp_path / "m", variant)
    logits, runner = prompt_logits(path, PROMPT)
    _experts_stay_quantized(runner)
    gate_up = _blocks(runner)[0].quantized.gate_up
    assert all((m.input_perm is not None) == variant.desc_act for m in gate_up)
    want = reference_logits(plain, PROMPT)
    torch.testing.assert_close(logits.double(), want, rtol=0, atol=5e-5)
    assert logits.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_the_engine_decodes_awq_mixtral_greedy_as_transformers_does(tmp_path, monkeypatch, demo_path):
    from tests.tiny_models import load_reference, reference_greedy

    monkeypatch.setenv(switches.CPU_W4A16, "1")  # inherited by the engine's processes
    path, plain = save_awq_gptq("mixtral", tmp_path / "m", hand.Variant("awq", group=32))
    prompts = [PROMPT, PROMPT[:5]]
    reference = load_reference(plain)
    want = [reference_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
             max_num_batched_tokens=8) as llm:
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want


def test_online_fp8_quantizes_the_experts_too(tmp_path, demo_path):
    # --quantization fp8 of a float MoE checkpoint: every expert per row, max |w| / 448 to e4m3
    # (the rule written here again), the router and the lm_head float.
    from safetensors.torch import load_file, save_file

    from tests.moe_quant_files import _linear_names, _quantized, _write, float_checkpoint
    from tests.tiny_models import load_reference, reference_greedy

    base = float_checkpoint("qwen3_moe", tmp_path / "float")
    tensors = load_file(str(base / "model.safetensors"))
    for name in filter(_quantized, _linear_names(tensors)):
        w = tensors[name + ".weight"]
        s = w.abs().amax(1, keepdim=True) / 448
        tensors[name + ".weight"] = (w / s).to(torch.float8_e4m3fn).float() * s
    plain = _write(base, tmp_path / "rounded", {})
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    want = [reference_greedy(load_reference(plain), p, GREEDY.max_tokens) for p in (PROMPT, PROMPT[:5])]
    with LLM(str(base), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=64, quantization="fp8") as llm:
        out = llm.generate([PROMPT, PROMPT[:5]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want


def _rank_main(rank: int, size: int, path: str, init: str, out: str) -> None:
    from tests import test_worker_tp

    runner = test_worker_tp._runner(path, size, rank, init)
    try:
        block = _blocks(runner)[0]
        assert block.quantized is not None and block.shared_down is not None
        facts = {"gate_up_rows": {m.out_features for m in block.quantized.gate_up},
                 "down_cols": {(m.in_features, m.weight_scale.shape[1]) for m in block.quantized.down},
                 "shared_down_cols": block.shared_down.in_features}
        outputs, logits = test_worker_tp._drive(runner, 512)
        torch.save({"outputs": outputs, "logits": logits, **facts}, out)
    finally:
        runner.close()


def test_tensor_parallel_ranks_take_their_experts_columns_and_groups(tmp_path, monkeypatch):
    # Two ranks: each expert's and the shared expert's gate/up rows and down's input columns
    # (32 of 64, one group of 32; 64 of 128 for the shared expert), one all_reduce per block.
    # Float activations (inherited by the ranks): the ranks' sums differ from one rank's in
    # float32 rounding only, which int8 rounding of activations would amplify by a step.
    monkeypatch.setenv(switches.CPU_W4A16, "1")
    import multiprocessing

    from noria.protocol.sockets import free_tcp_port
    from tests.test_worker_tp import _drive
    from tests.test_worker_tp import _runner as _tp_runner

    path, _ = save_compressed("qwen2_moe", tmp_path / "m", "w4a16_g32")
    single, single_logits = _drive(_tp_runner(str(path), 1), 512)
    ctx, init = multiprocessing.get_context("spawn"), f"tcp://127.0.0.1:{free_tcp_port()}"
    files = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(path), init, str(files[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"rank exit codes {codes}"
    ranks = [torch.load(f) for f in files]
    for got in ranks:
        assert got["outputs"] == single
        assert (got["gate_up_rows"], got["down_cols"], got["shared_down_cols"]) == ({64}, {(32, 1)}, 64)
    for a, b in zip(ranks[0]["logits"], single_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- refusals, before a weight is read ------------------------------------------------------------

def test_experts_quantized_differently_are_refused(tmp_path, demo_path):
    path, _ = save_compressed("qwen3_moe", tmp_path / "m", "w4a16_g32")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.1.mlp.experts.3.down_proj")
    (path / "config.json").write_text(json.dumps(cfg))
    words = r"the experts of layer 1 are quantized differently \(expert 0: W4A16 g32 gate/up, W4A16 g32 down; " \
            r"expert 3: W4A16 g32 gate/up, float down\)"
    with pytest.raises(ValueError, match=words):
        read_spec(path)
    with pytest.raises(CheckpointError, match=words):
        check_checkpoint(path)
    with pytest.raises(ValueError, match=words), LLM(str(path), tokenizer=str(demo_path), dtype="float32"):
        pass


def test_a_gguf_mixture_of_experts_is_refused():
    from tests.tiny_models import tiny_config

    cfg = tiny_config("qwen3_moe").to_dict()
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": "m.gguf", "tensor_types": {}}
    with pytest.raises(ValueError, match=r"GGUF mixture-of-experts models \(Qwen3MoeForCausalLM\) are not "
                                         "supported yet"):
        model_spec(cfg)


def test_the_pre_check_names_a_missing_expert_tensor(tmp_path):
    path, _ = save_awq_gptq("qwen3_moe", tmp_path / "m", hand.Variant("awq", group=32))
    assert check_checkpoint(path).num_experts == 8
    hand.edit(path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.qzeros"))
    with pytest.raises(CheckpointError, match=r"lacks 1 weight tensor\(s\).*layers\.1\.mlp\.experts\.5\.up_proj\.qzeros"):
        check_checkpoint(path)
