"""GGUF files as models (`--model file.gguf`): F32/F16/BF16, Q8_0, Q4_0, Q4_K, Q6_K and the Q4_K_M mix,
for the Llama (and Mistral, as llama.cpp converts it), Qwen2/3 and Gemma 2/3 families. The other
block types are in tests/test_gguf_types.py, the metadata transformers does not read (rope
scaling, Gemma's soft-caps and scale) in tests/test_gguf_families.py.

The files are written here by the gguf package's writer from tiny seeded transformers models, as
llama.cpp's converter lays them out (tests/gguf_files.py). The reference is transformers' own
GGUF loading of the same file, which dequantizes every tensor to float32 with the gguf package:
noria computes with the same float32 weights (q * scale [- min], each product exact), so every
position's logits agree to float32 rounding and greedy decoding is identical. The tokenizer and
chat template come from the file's metadata, as transformers' GGUF tokenizer reads them.

4-bit layers run on float32 activations here ($NORIA_CPU_W4A16), as transformers computes them;
their default on a CPU, int8 activations per group, is tested against a reference that rounds the
same way (`test_q4_0_and_q4_k_on_int8_activations`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from noria import LLM, SamplingParams
from noria.frontend.gguf_view import gguf_view
from noria.protocol import switches
from noria.protocol.checkpoint import CheckpointError, check_checkpoint
from noria.protocol.gguf_file import hf_name
from noria.protocol.gguf_quant import gguf_quant
from noria.worker import gemm_quant_kernels
from noria.worker.gguf_blocks import DECODERS
from noria.worker.model_runner import ModelRunner
from noria.worker.models.quant_linear import QuantLinear
from tests import gguf_files as gf
from tests.quant_checks import check_layers_on_their_inputs, check_logits, fake_quant, prompt_logits
from tests.tiny_models import reference_greedy

PROMPT = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]
_BLOCK_BYTES = {"Q8_0": (32, 34, [0]), "Q4_0": (32, 18, [0]), "Q4_K": (256, 144, [0, 2]), "Q6_K": (256, 210, [208])}


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(switches.CPU_W4A16, "1")


@pytest.fixture(scope="module")
def vocab(demo_path: Path) -> int:
    return len(json.loads((demo_path / "tokenizer.json").read_text())["model"]["vocab"])


def _file(tmp: Path, arch: str, vocab: int, types: gf.TypeRule, tokenizer: Path, **kw: Any) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    return gf.write_gguf(gf.tiny_model(arch, vocab, **kw), tmp / f"{arch}.gguf", arch, types, tokenizer)


def _logits(view: Path, num_kv_blocks: int = 64) -> tuple[torch.Tensor, ModelRunner]:
    return prompt_logits(view, PROMPT, num_kv_blocks)


def _check_against_transformers(path: Path, config: Any = None) -> ModelRunner:
    logits, runner = _logits(gguf_view(path))
    with torch.inference_mode():
        want = gf.reference(path, config)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=2e-5)  # float32 rounding
    assert logits.argmax(-1).tolist() == want.argmax(-1).tolist()
    return runner


# -- the blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(_BLOCK_BYTES))  # the others: tests/test_gguf_types.py
def test_decoded_blocks_are_the_gguf_packages_dequantization_exactly(kind):
    # Random bytes (every bit pattern of values, sub-scales and minimums) with finite f16 scales.
    block, size, f16_at = _BLOCK_BYTES[kind]
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (6, 2 * size), dtype=np.uint8).reshape(6, 2, size)
    for at in f16_at:
        data[..., at:at + 2] = rng.uniform(-0.01, 0.01, (6, 2, 1)).astype(np.float16).view(np.uint8)
    data = data.reshape(6, -1)
    values, scales, mins = DECODERS[kind](data, 6)
    g = values.shape[1] // scales.shape[1]
    w = values.astype(np.float32).reshape(6, -1, g) * scales[..., None]
    if mins is not None:
        w = w - mins[..., None]
    assert np.array_equal(w.reshape(6, -1), dequantize(data, GGMLQuantizationType[kind]))
    assert values.dtype == np.int8 and scales.dtype == np.float32


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_the_hand_packed_k_quants_follow_ggmls_layout(kind):
    w = (np.random.default_rng(2).standard_normal((4, 512)) * 0.05).astype(np.float32)
    blob, qtype = gf.encode(w, kind)
    back = dequantize(blob, qtype)  # the gguf package's reading of the bytes
    assert np.abs(back - w).max() < (0.01 if kind == "Q4_K" else 0.004)


def test_fused_parts_of_different_types_share_one_exact_scheme():
    types = {f"model.layers.0.self_attn.{p}_proj": [f"blk.0.attn_{p}.weight", t]
             for p, t in (("q", "Q4_K"), ("k", "Q4_K"), ("v", "Q6_K"), ("o", "Q4_K"))}
    types |= {f"model.layers.0.mlp.{p}_proj": [f"blk.0.ffn_{p}.weight", t]
              for p, t in (("gate", "Q8_0"), ("up", "F16"), ("down", "Q6_K"))}
    q = gguf_quant({"quant_method": "gguf", "gguf_file": "x.gguf", "tensor_types": types})
    qkv = q.fused_scheme([f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
    assert qkv is not None and (qkv.bits, qkv.group, qkv.minimum) == (8, 16, True)
    assert q.scheme_for("model.layers.0.self_attn.o_proj").minimum
    assert q.fused_scheme(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]) is None  # F16 up
    assert q.scheme_for("model.layers.0.mlp.down_proj").group == 16


def test_tensor_names_are_the_gguf_packages_own():
    from gguf import MODEL_ARCH, get_tensor_name_map

    hf = ["model.embed_tokens", "model.norm", "lm_head"] + [f"model.layers.3.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3"):
        names = get_tensor_name_map(MODEL_ARCH[arch.upper()], 4)
        for name in hf:
            g = names.get_name(name)
            if g is not None:
                assert hf_name(g + ".weight", arch) == name + ".weight", (arch, name, g)


# -- the model against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("types", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M"])
def test_every_position_matches_transformers_on_the_same_file(tmp_path, types, vocab, demo_path):
    rule = gf.q4_k_m if types == "Q4_K_M" else gf.every(types, embedding="Q8_0" if types == "Q4_0" else "F32")
    runner = _check_against_transformers(_file(tmp_path, "llama", vocab, rule, demo_path))
    quant = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    if types in ("F32", "F16", "BF16"):
        assert not quant
        return
    assert len(quant) == 2 * 4 + 1  # qkv, o, gate_up, down in both layers, and the lm_head
    # The weights stay integers: no float copy of a quantized layer is kept.
    assert all(m.weight.is_meta and (m.op.native or m.qweight.dtype == torch.int8) for m in quant)
    if types == "Q4_K_M":  # q/k Q4_K beside v Q6_K: one layer, groups of 16, minimums
        s = runner.model.layers[0].self_attn.qkv_proj.scheme
        assert (s.group, s.minimum) == (16, True)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("types", ["Q4_0", "Q4_K"])
def test_q4_0_and_q4_k_on_int8_activations(tmp_path, monkeypatch, types, vocab, demo_path):
    # The CPU's default for 4-bit layers: activations rounded to int8 per group of 32 (the
    # weights' group), int32 sums per group. Each layer on the inputs it sees, and the logits
    # within the rounding's own reach (tests/quant_checks.py).
    on_int8_activations(tmp_path, monkeypatch, gf.every(types, embedding="Q8_0"), vocab, demo_path, "packed_w4a8", 32)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize(("types", "group"), [("Q8_0", 32), ("Q6_K", 16)])
def test_q8_0_and_q6_k_on_int8_activations(tmp_path, monkeypatch, types, group, vocab, demo_path):
    # 8-bit layers too (W8A8g): activations rounded to int8 per group of the weights' group (32
    # for Q8_0, 16 for Q6_K), int32 sums per group, as llama.cpp computes them.
    on_int8_activations(tmp_path, monkeypatch, gf.every(types), vocab, demo_path, "packed_w8a8g", group)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
def test_q4_k_m_on_int8_activations(tmp_path, monkeypatch, vocab, demo_path):
    # The mix: Q4_K layers on W4A8, Q6_K ones and q/k/v fused of Q4_K and Q6_K parts (8-bit
    # containers with minimums, groups of 16) on W8A8g; each layer on the inputs it sees.
    monkeypatch.delenv(switches.CPU_W4A16)
    _, runner = _logits(gguf_view(_file(tmp_path, "llama", vocab, gf.q4_k_m, demo_path)))
    quant = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.op.kind for m in quant} == {"packed_w4a8", "packed_w8a8g"}
    assert {m.op.kind for m in quant if m.scheme.bits == 8} == {"packed_w8a8g"}
    assert any(m.scheme.minimum and m.op.kind == "packed_w8a8g" for m in quant)
    assert check_layers_on_their_inputs(runner, PROMPT) == len(quant)


def on_int8_activations(tmp_path, monkeypatch, rule, vocab, demo_path, kind, group):
    """Every layer of the file's model on `kind`, each on the inputs it sees, and the logits against a
    reference rounding every linear layer's inputs per group of `group`."""
    monkeypatch.delenv(switches.CPU_W4A16)
    path = _file(tmp_path, "llama", vocab, rule, demo_path)
    logits, runner = _logits(gguf_view(path))
    quant = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.op.kind for m in quant} == {kind} and len(quant) == 9
    assert check_layers_on_their_inputs(runner, PROMPT) == 9
    model = gf.reference(path)
    with torch.inference_mode():
        plain = model(torch.tensor([PROMPT])).logits[0]
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda m, args: (fake_quant(args[0], group),))
        hooked = model(torch.tensor([PROMPT])).logits[0]
    check_logits(logits, hooked, plain)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_each_family_matches_transformers_in_q4_k_m(tmp_path, arch, vocab, demo_path):
    # Gemma 2 files are tied (llama.cpp writes no output tensor for it); Qwen2 has q/k/v biases.
    # Gemma's soft-caps and attention scale are the metadata's, as llama.cpp reads it, which
    # transformers' config reading drops: its reference takes the converted model's config.
    model = gf.tiny_model(arch, vocab, tied=arch == "gemma2")
    path = gf.write_gguf(model, tmp_path / f"{arch}.gguf", arch, gf.q4_k_m, demo_path)
    _check_against_transformers(path, model.config if arch.startswith("gemma") else None)


# -- the engine, tokenizer and chat template ------------------------------------------------------


def test_the_engine_serves_the_file_with_its_own_tokenizer(tmp_path, vocab, demo_path):
    path = _file(tmp_path, "llama", vocab, gf.q4_k_m, demo_path)
    ref = gf.reference(path)
    from transformers import AutoTokenizer

    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "The quick brown fox jumps over the lazy dog. café 東京"
    messages = [{"role": "user", "content": "Hello, world!"}]
    with LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=4) as llm:
        tok = llm.tokenizer
        assert tok.encode(text) == want_tok.encode(text) and tok.decode(want_tok.encode(text)) == want_tok.decode(
            want_tok.encode(text))
        assert want_tok.decode(want_tok.encode(text), skip_special_tokens=True) == text
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            want_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        out = llm.generate([PROMPT, text], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(ref, PROMPT, 10)
    assert out[1].prompt_token_ids == want_tok.encode(text)
    assert out[1].outputs[0].token_ids == reference_greedy(ref, want_tok.encode(text), 10)


def test_tokenizer_flag_overrides_the_files(tmp_path, vocab, demo_path):
    other = tmp_path / "tok"
    other.mkdir()
    for f in demo_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (other / f.name).write_bytes(f.read_bytes())
    (other / "chat_template.jinja").write_text("OVERRIDE {{ messages[0]['content'] }}")
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = _file(tmp_path / "m", "llama", vocab, gf.every("Q8_0"), demo_path)
    with LLM(str(path), tokenizer=str(other), dtype="float32", num_kv_blocks=16) as llm:
        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "OVERRIDE hi"


def test_a_process_without_torch_builds_the_same_view(tmp_path, vocab, demo_path):
    # `noria serve`'s frontend keeps torch out (frontend/no_torch.py): the view is derived in a child.
    path = _file(tmp_path, "qwen2", vocab, gf.every("Q8_0"), demo_path)
    here = gguf_view(path)
    script = ("import sys; sys.modules['torch'] = None\n"
              "from noria.frontend.gguf_view import gguf_view\n"
              f"print(gguf_view({str(path)!r}))\nassert sys.modules['torch'] is None\n")
    env_cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          env={**_env(), "NORIA_CACHE": str(env_cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    there = Path(proc.stdout.strip().splitlines()[-1])
    assert there.parent.parent == env_cache
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert json.loads((there / name).read_text()) == json.loads((here / name).read_text()), name


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


# -- refusals, before anything is served --------------------------------------------------------


def _raw(rule_kind: str, name_part: str) -> gf.TypeRule:
    return lambda name: rule_kind if name_part in name else ("F32" if "norm" in name else "Q8_0")


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path, vocab, demo_path):
    path = _file(tmp_path, "llama", vocab, gf.every("Q8_0"), demo_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match=r"is truncated: tensor (\S+) ends at byte"), \
            LLM(str(path), dtype="float32", num_kv_blocks=16):
        pass


@pytest.mark.parametrize("kind", ["IQ4_XS", "IQ2_XXS"])
def test_a_linear_layer_of_an_unsupported_type_is_refused(tmp_path, vocab, demo_path, monkeypatch, kind):
    # The gguf package quantizes neither: the blocks are random bytes of the type's size.
    def encode(w: np.ndarray, k: str) -> tuple[np.ndarray, GGMLQuantizationType]:
        if k != kind:
            return real(w, k)
        from gguf.constants import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[k]]
        return np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), GGMLQuantizationType[k]

    real = gf.encode
    monkeypatch.setattr(gf, "encode", encode)
    path = _file(tmp_path, "llama", vocab, _raw(kind, "blk.1.ffn_down"), demo_path)
    words = f"GGUF tensor blk.1.ffn_down.weight (model.layers.1.mlp.down_proj) is of type {kind}"
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")), \
            LLM(str(path), dtype="float32", num_kv_blocks=16):
        pass


def test_an_unknown_architecture_is_refused(tmp_path, vocab, demo_path):
    path = _file(tmp_path, "llama", vocab, gf.every("Q8_0"), demo_path)
    data = path.read_bytes()
    # "llama" -> "llamb" everywhere in the header: general.architecture and every key's prefix.
    path.write_bytes(data.replace(b"llama", b"llamb"))
    with pytest.raises(CheckpointError, match="GGUF architecture 'llamb', which noria does not load"), \
            LLM(str(path), dtype="float32", num_kv_blocks=16):
        pass


def test_a_tensor_of_the_wrong_shape_is_refused_by_the_pre_check(tmp_path, vocab, demo_path):
    path = _file(tmp_path, "qwen2", vocab, gf.every("Q8_0"), demo_path)
    view = gguf_view(path)
    cfg = json.loads((view / "config.json").read_text())
    cfg["intermediate_size"] = 768  # the file's ffn tensors are 512 wide
    (view / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"GGUF tensor blk\.0\.ffn_gate\.weight has shape \(512, 256\)"):
        check_checkpoint(view)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
def test_a_q4_k_m_file_of_mixed_kinds_runs_on_the_native_stack(tmp_path, monkeypatch, vocab, demo_path):
    # Q4_K layers beside Q6_K ones and fused layers of both: the driver calls one entry, which
    # reads each layer's descriptor, so every layer runs there, bit for bit the Python path.
    from noria.worker import native_coverage
    from tests.test_worker_native_stack import STEPS, _forward

    monkeypatch.delenv(switches.CPU_W4A16)
    # 128 blocks: the steps' block tables (tests/test_worker_native_stack.py) do not wrap onto each other.
    _, runner = _logits(gguf_view(_file(tmp_path, "llama", vocab, gf.q4_k_m, demo_path)), num_kv_blocks=128)
    kinds = {m.op.kind for m in runner.model.modules() if isinstance(m, QuantLinear)}
    assert {"packed_w4a8", "packed_w8a8g"} <= kinds, kinds
    assert native_coverage.coverage(runner.model, runner._kv_layers) == [None, None]
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)
    for name, step in STEPS.items():
        native, ran = _forward(runner, step, native=True)
        python, _ = _forward(runner, step, native=False)
        assert ran == (name != "long prompt") and torch.equal(native, python), name
