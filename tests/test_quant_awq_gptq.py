"""AWQ (AutoAWQ's GEMM layout) and GPTQ (4 and 8 bits, desc_act false and true) checkpoints.

The checkpoints are packed here from the formats' documentation (tests/awq_gptq_files.py), and
the reference is transformers running the same tiny Llama with the weights a dequantizer written
apart from noria reads back from the packed files. With float32 activations (NORIA_CPU_W4A16)
noria computes the same products: every position's logits agree to float32 rounding (a kernel
scales each group's sum, the reference each weight) and greedy decoding is identical. With the
default kinds (activations rounded to int8 per group) every layer is checked on its own inputs
and the logits within the rounding's reach (tests/quant_checks.py). No reference package is
used: gptqmodel needs a newer torch than the project's and AutoAWQ (deprecated) imports
transformers 4.x model code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol import switches
from noria.protocol.model_spec import read_spec
from noria.worker import gemm_quant_kernels, native_coverage
from noria.worker.models.parallel import TensorParallel
from noria.worker.models.quant_linear import QuantLinear, RowParallelQuantLinear, TorchQuantOp
from tests import awq_gptq_files as hand
from tests.awq_gptq_files import INPUTS, Variant, edit
from tests.quant_checks import check_layers_on_their_inputs, check_logits, fake_quant, prompt_logits
from tests.tiny_models import make_model, reference_greedy

# hidden 256, intermediate 512: groups of 128 divide every layer, and each rank's half of
# o_proj (128 features) and down_proj (256) under two ranks.
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPT = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]
AWQ = Variant("awq")
GPTQ4 = Variant("gptq")
GPTQ4_ACT = Variant("gptq", desc_act=True)
GPTQ8_CHANNEL = Variant("gptq", bits=8, group=-1)
GPTQ8_ACT_V2 = Variant("gptq", bits=8, desc_act=True, fmt="gptq_v2")
GPTQ4_ASYM = Variant("gptq", sym=False)


def make(path: Path, variant: Variant, seed: int = 0) -> tuple[Path, Any]:
    """A tiny seeded Llama saved in `variant`'s layout, and transformers' model of its dequantized weights."""
    model = make_model("llama", seed=seed, **SIZES)
    model.generation_config.eos_token_id = None
    return hand.save(model, path, variant), model


# -- the layouts, one module at a time ----------------------------------------------------------

@pytest.mark.parametrize("variant", [AWQ, GPTQ4, GPTQ4_ACT, GPTQ8_CHANNEL, GPTQ8_ACT_V2, GPTQ4_ASYM],
                         ids=lambda v: f"{v.method}{v.bits}-g{v.group}-act{int(v.desc_act)}-sym{int(v.sym)}-{v.fmt}")
def test_a_module_reads_back_as_the_documented_dequantizer_reads_it(variant):
    # The layer's dequantized weight (its input permutation undone) equals the independent
    # float64 reading of the packed words exactly (every product is an f16 times a small
    # integer), and that reading is within half a step of the float weight it was made from
    # (a step where it was clipped). The values are converted before g_idx here: the layer
    # permutes them in place once it reads it (a whole checkpoint stores g_idx first).
    from noria.protocol.quant_awq_gptq import awq_gptq_quant

    gen = torch.Generator().manual_seed(3)
    n, k = 96, 256
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    group = k if variant.group == -1 else variant.group
    g_idx = (torch.arange(k) // group).int()
    if variant.desc_act:
        g_idx[torch.randperm(k, generator=gen)] = g_idx.clone()
    sym = variant.sym and variant.method == "gptq"
    q, scale, zero = hand.quantize(w.float(), variant.bits, group, sym, g_idx)
    if variant.method == "awq":
        files = {"qweight": hand.pack_awq(q), "qzeros": hand.pack_awq(zero), "scales": scale}
    else:
        stored = (zero - 1 if variant.fmt == "gptq" else zero) & ((1 << variant.bits) - 1)
        files = {"qweight": hand.pack_rows(q, variant.bits), "qzeros": hand.pack_columns(stored, variant.bits),
                 "scales": scale, "g_idx": g_idx}
    want = hand.dequantize(files, variant)
    step, err = scale.double()[g_idx.long()].t(), (want - w).abs()
    inside = ((q > 0) & (q < (1 << variant.bits) - 1)).t()  # a symmetric grid clips its top value
    assert (err[inside] <= step[inside] / 2 + 1e-12).all() and (err <= step + 1e-12).all()

    spec = awq_gptq_quant(variant.config())
    scheme = spec.scheme_for("model.layers.0.mlp.down_proj")
    layer = QuantLinear(k, n, False, scheme)
    with torch.no_grad():
        for t in layer.checkpoint_tensors():
            if t.param is None and t.suffix not in files:  # optional (a quantizer's zero bias)
                continue
            value = t.convert(files[t.suffix], n, t.suffix) if t.convert else files[t.suffix]
            if t.param is not None and t.param.numel():
                t.param.copy_(value)
    got = TorchQuantOp(layer).dequantized().double()
    if layer.input_perm is not None:
        got = got[:, torch.argsort(layer.input_perm)]
    assert (layer.input_perm is not None) == variant.desc_act
    assert torch.equal(got, want)


# -- whole models --------------------------------------------------------------------------------

def _hooked(model: Any, runner: Any) -> Any:
    """`model` with each quantized layer's input rounded to int8 as noria's kind rounds it: per
    group of its weights' group, taken in the layer's (permuted) order of the input features."""
    handles = []
    layers = {f"model.layers.{i}.{name}": (layer, key) for i, layer in enumerate(runner.model.layers)
              for name, key in INPUTS.items()}
    for name, module in model.named_modules():
        if name not in layers:
            continue
        layer, key = layers[name]
        lin = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj}[key]
        group = 0 if lin.op.kind == "packed_w8a8" else lin.group
        perm = lin.input_perm

        def hook(m: Any, args: Any, perm: Any = perm, group: int = group) -> Any:
            x = args[0]
            if perm is None:
                return (fake_quant(x, group),)
            out = torch.empty_like(x)
            out[..., perm] = fake_quant(x[..., perm], group)
            return (out,)
        handles.append(module.register_forward_pre_hook(hook))
    return handles


@pytest.mark.parametrize("variant", [AWQ, GPTQ4, GPTQ4_ACT, GPTQ8_CHANNEL, GPTQ8_ACT_V2],
                         ids=["awq-g128", "gptq4-g128", "gptq4-g128-desc_act", "gptq8-channel",
                              "gptq8-g128-desc_act-v2"])
def test_every_position_matches_transformers_on_the_dequantized_weights(tmp_path, monkeypatch, variant):
    path, reference = make(tmp_path / "m", variant)
    with torch.inference_mode():
        plain = reference(torch.tensor([PROMPT])).logits[0]
    monkeypatch.setenv(switches.CPU_W4A16, "1")
    logits, runner = prompt_logits(path, PROMPT)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4 and runner.model.lm_head.__class__.__name__ == "Linear"  # lm_head float
    assert all((m.input_perm is not None) == variant.desc_act for m in layers)
    # Logits up to about 6, float32 sums of up to 512 products scaled per group rather than per
    # weight: off by under 2e-5 as seen; the top two logits of a position are 6e-3 apart or more.
    torch.testing.assert_close(logits, plain, rtol=0, atol=5e-5)
    assert logits.argmax(-1).tolist() == plain.argmax(-1).tolist()
    reasons = native_coverage.coverage(runner.model, runner._kv_layers)
    if variant.desc_act:
        assert reasons == ["qkv, o, gate_up, down permute their input features (GPTQ desc_act)"] * 2
    monkeypatch.delenv(switches.CPU_W4A16)
    if not gemm_quant_kernels.usable():
        return
    logits, runner = prompt_logits(path, PROMPT)  # the default kinds: activations rounded to int8
    assert check_layers_on_their_inputs(runner, PROMPT) == 8
    handles = _hooked(reference, runner)
    try:
        with torch.inference_mode():
            hooked = reference(torch.tensor([PROMPT])).logits[0]
    finally:
        for h in handles:
            h.remove()
    check_logits(logits, hooked, plain)


@pytest.mark.parametrize("variant", [AWQ, GPTQ4_ACT], ids=["awq", "gptq-desc_act"])
def test_the_engine_decodes_greedy_as_transformers_does(tmp_path, monkeypatch, variant, demo_path):
    # Float32 activations (the worker inherits the switch): the logits agree to 5e-5 above, and
    # greedy tokens are the same where no two candidates are that close.
    monkeypatch.setenv(switches.CPU_W4A16, "1")
    path, reference = make(tmp_path / "m", variant)
    prompts = [PROMPT, PROMPT[:5]]
    want = [reference_greedy(reference, p, 10) for p in prompts]
    with LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
             max_num_batched_tokens=8) as llm:
        out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want


def test_tensor_parallel_ranks_take_their_groups_with_their_columns(tmp_path):
    # AWQ, two ranks: q/k/v and gate/up cut by output rows, o_proj and down_proj by input
    # features with their groups' scales and zero points (one group of 128 and two per rank).
    from tests.test_worker_tp import _drive, _run_ranks
    from tests.test_worker_tp import _runner as _tp_runner

    path, _ = make(tmp_path / "m", AWQ)
    single, single_logits = _drive(_tp_runner(str(path), 1), 512)
    ranks = _run_ranks(path, 2, 512, tmp_path)
    assert [r["outputs"] for r in ranks] == [single, single]
    for a, b in zip(ranks[0]["logits"], single_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_desc_act_on_a_row_parallel_layer_is_refused_under_tensor_parallelism():
    from noria.protocol.quant_awq_gptq import awq_gptq_quant

    scheme = awq_gptq_quant(GPTQ4_ACT.config()).scheme_for("model.layers.0.mlp.down_proj")
    layer = RowParallelQuantLinear(256, 256, False, TensorParallel(0, 2), scheme)
    with pytest.raises(ValueError, match="desc_act .* row-parallel layer .* not supported with tensor parallelism"):
        layer.checkpoint_tensors()


# -- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("quant", "words"), [
    ({**AWQ.config(), "version": "gemv"}, "AWQ version 'gemv'"),
    ({**AWQ.config(), "version": "exllama"}, "AWQ version 'exllama'"),
    ({**AWQ.config(), "zero_point": False}, "AWQ without zero points"),
    ({**AWQ.config(), "backend": "llm-awq"}, "AWQ backend 'llm-awq'"),
    ({**GPTQ4.config(), "bits": 3}, "GPTQ with 3-bit weights"),
    ({**GPTQ4.config(), "dynamic": {"-:.*down_proj": {}}}, "GPTQ per-module overrides"),
    ({**GPTQ4.config(), "lm_head": True}, "a GPTQ-quantized lm_head"),
    ({**GPTQ4.config(), "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
])
def test_unsupported_variants_are_refused_in_one_sentence(tmp_path, quant, words):
    path = tmp_path / "m"
    path.mkdir()
    make_model("llama", **SIZES).config.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match=f"{words}.* is not supported yet; noria loads") as err:
        read_spec(path)
    assert str(err.value).count(". ") == 0


def test_the_spec_reads_the_settings():
    from noria.protocol.quant_awq_gptq import awq_gptq_quant

    awq = awq_gptq_quant({**AWQ.config(), "modules_to_not_convert": ["down_proj"]})
    assert awq.scheme_for("lm_head") is None and awq.scheme_for("model.layers.1.mlp.down_proj") is None
    s = awq.scheme_for("model.layers.1.mlp.up_proj")
    assert s is not None and (s.bits, s.group, s.symmetric, s.layout) == (4, 128, False, "awq")
    g = awq_gptq_quant({**GPTQ8_ACT_V2.config(), "modules_in_block_to_quantize": [["self_attn.q_proj"]]})
    s = g.scheme_for("model.layers.0.self_attn.q_proj")
    assert s is not None and (s.bits, s.symmetric, s.act_order, s.layout) == (8, True, True, "gptq_v2")
    assert g.scheme_for("model.layers.0.self_attn.k_proj") is None
    assert g.describe == "gptq W8A16 g128 desc_act gptq_v2"
    assert awq_gptq_quant(GPTQ8_CHANNEL.config()).scheme_for("model.layers.0.mlp.up_proj").group is None


def _wrong_scale(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.1.mlp.up_proj.scales"] = t["model.layers.1.mlp.up_proj.scales"][:, :-8].contiguous()


def test_a_scale_of_the_wrong_shape_is_refused_before_anything_is_served(tmp_path, demo_path):
    path = edit(make(tmp_path / "m", GPTQ4)[0], _wrong_scale)
    name = "model.layers.1.mlp.up_proj.scales"
    with pytest.raises(Exception, match=rf"tensor {name} has shape \(2, 504\) but config.json implies \(2, 512\)"), \
            LLM(str(path), tokenizer=str(demo_path), dtype="float32", num_kv_blocks=16):
        pass
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(2, 504\), expected \(2, 512\)"):
        prompt_logits(path, PROMPT)  # the worker's own reading says the same


def _swap_k_order(t: dict[str, torch.Tensor]) -> None:
    g = t["model.layers.0.self_attn.k_proj.g_idx"]
    t["model.layers.0.self_attn.k_proj.g_idx"] = g.flip(0).contiguous()


def _unbalanced(t: dict[str, torch.Tensor]) -> None:
    g = t["model.layers.0.mlp.down_proj.g_idx"].clone()
    g[0] = 1 - g[0]
    t["model.layers.0.mlp.down_proj.g_idx"] = g


def _no_g_idx(t: dict[str, torch.Tensor]) -> None:
    for part in ("q_proj", "k_proj", "v_proj"):
        del t[f"model.layers.1.self_attn.{part}.g_idx"]


def _asym_zero(t: dict[str, torch.Tensor]) -> None:
    z = t["model.layers.0.self_attn.o_proj.qzeros"].clone()
    z[1, 3] = 0x77777778
    t["model.layers.0.self_attn.o_proj.qzeros"] = z


def _zero_biases(t: dict[str, torch.Tensor]) -> None:
    # AutoGPTQ's and AutoAWQ's layers save a bias buffer for bias-free models: zeros.
    for name in [n for n in t if n.endswith(".qweight")]:
        t[name.replace(".qweight", ".bias")] = torch.zeros(t[name.replace(".qweight", ".scales")].shape[1])


def _nonzero_bias(t: dict[str, torch.Tensor]) -> None:
    _zero_biases(t)
    t["model.layers.1.mlp.up_proj.bias"][3] = 0.5


def test_the_zero_biases_quantizers_save_for_bias_free_layers_load(tmp_path):
    plain = prompt_logits(make(tmp_path / "plain", GPTQ4)[0], PROMPT)[0]
    with_biases = prompt_logits(edit(make(tmp_path / "biases", GPTQ4)[0], _zero_biases), PROMPT)[0]
    assert torch.equal(plain, with_biases)


def _float_qweight(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.gate_proj.qweight"] = t["model.layers.0.mlp.gate_proj.qweight"].float()


@pytest.mark.parametrize(("variant", "change", "words"), [
    (GPTQ4_ACT, _swap_k_order, r"'model.layers.0.self_attn.(k|q)_proj.g_idx' orders the input features "
                               r"differently from 'model.layers.0.self_attn.(q|k)_proj.g_idx', a module fused"),
    (GPTQ4_ACT, _unbalanced, "'model.layers.0.mlp.down_proj.g_idx' does not put exactly 128 input features"),
    (GPTQ4_ACT, _no_g_idx, "missing weights for: layers.1.self_attn.qkv_proj.g_idx"),
    (GPTQ4, _unbalanced, "'model.layers.0.mlp.down_proj.g_idx' orders the input features by activation, but "
                         "the config says desc_act false"),
    (GPTQ4, _asym_zero, "'model.layers.0.self_attn.o_proj.qzeros' holds a zero point of 9, but the config says sym"),
    (AWQ, _float_qweight, "'model.layers.0.mlp.gate_proj.qweight' is float32, expected int32"),
    (AWQ, _nonzero_bias, "'model.layers.1.mlp.up_proj.bias' is a bias of \\[512\\] with non-zero values"),
], ids=["fused-orders-differ", "unbalanced-groups", "no-g_idx", "g_idx-without-desc_act", "sym-zero", "dtype",
        "nonzero-bias"])
def test_bad_tensors_are_refused_naming_them(tmp_path, variant, change, words):
    path = edit(make(tmp_path / "m", variant)[0], change)
    with pytest.raises(ValueError, match=words):
        prompt_logits(path, PROMPT)
