"""GGUF's other block types: Q4_1, Q5_0, Q5_1, IQ4_NL (what llama-quantize mixes into K-quant files
where a row is not a multiple of 256) and Q5_K, Q3_K, Q2_K, each computed in its own layout:
integer values, float32 scales and minimums in QuantLinear's form (protocol/gguf_quant.py).

Each decoder is checked on random bytes against the gguf package's dequantizer (the reading
transformers and llama.cpp's Python tools use), in float64 and as the float32 the layers compute.
Files are written as tests/test_gguf.py writes them; the reference is transformers' GGUF loading
of the same file, which noria's float32 logits match to float32 rounding (atol 2e-5) since every
weight is the same exact product. 4-bit layers run on float32 activations here, as there; the
CPU's default (int8 activations per group) is checked against a reference that rounds the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from noria.frontend.gguf_view import gguf_view
from noria.protocol import switches
from noria.protocol.checkpoint import CheckpointError
from noria.protocol.gguf_quant import SCHEMES, gguf_quant
from noria.worker import gemm_quant_kernels
from noria.worker.gguf_blocks import DECODERS
from noria.worker.models.quant_linear import QuantLinear
from tests import gguf_files as gf
from tests.gguf_kquants import PACKERS
from tests.quant_checks import prompt_logits
from tests.test_gguf import PROMPT, on_int8_activations

NEW = ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q5_K", "Q3_K", "Q2_K")
# Where each block's f16 fields sit (random bytes there could be inf or NaN).
_F16_AT = {"Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0], "Q5_K": [0, 2], "Q3_K": [108],
           "Q2_K": [80, 82]}
# (container bits, group, minimum) each type loads as, and the int8-activation kind it runs on.
_SCHEME = {"Q4_1": (4, 32, True, "packed_w4a8"), "Q5_0": (8, 32, False, "packed_w8a8g"),
           "Q5_1": (8, 32, True, "packed_w8a8g"), "IQ4_NL": (8, 32, False, "packed_w8a8g"),
           "Q5_K": (8, 32, True, "packed_w8a8g"), "Q3_K": (4, 16, False, "packed_w4a8"),
           "Q2_K": (4, 16, True, "packed_w4a8")}


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(switches.CPU_W4A16, "1")


@pytest.fixture(scope="module")
def vocab(demo_path: Path) -> int:
    return len(json.loads((demo_path / "tokenizer.json").read_text())["model"]["vocab"])


def _random_blocks(kind: str, rows: int = 6, blocks: int = 2) -> np.ndarray:
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in _F16_AT[kind]:
        data[..., at:at + 2] = rng.uniform(-0.01, 0.01, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", NEW)
def test_each_new_type_decodes_to_the_gguf_packages_values(kind):
    data = _random_blocks(kind)
    values, scales, mins = DECODERS[kind](data, 6)
    bits, group, minimum, _ = _SCHEME[kind]
    assert values.dtype == np.int8 and scales.dtype == np.float32 and (mins is not None) == minimum
    assert values.shape[1] // scales.shape[1] == group
    lo, hi = (0, 15) if minimum else (-8, 7)
    assert bits == 8 or lo <= values.min() <= values.max() <= hi  # what a 4-bit container holds
    want = dequantize(data, GGMLQuantizationType[kind])

    def weights(dtype: type) -> np.ndarray:
        w = values.astype(dtype).reshape(6, -1, group) * scales.astype(dtype)[..., None]
        return (w if mins is None else w - mins.astype(dtype)[..., None]).reshape(6, -1)

    # In float64 each product is exact: only the package's float32 rounding of its result differs.
    np.testing.assert_allclose(weights(np.float64), want.astype(np.float64), rtol=2**-23, atol=1e-12)
    # And in float32, the order QuantLinear computes (q * scale - min), bit for bit.
    assert np.array_equal(weights(np.float32), want)


@pytest.mark.parametrize("kind", list(PACKERS))
def test_the_hand_packed_blocks_follow_ggmls_layout(kind):
    w = (np.random.default_rng(2).standard_normal((4, 512)) * 0.05).astype(np.float32)
    back = dequantize(PACKERS[kind](w), GGMLQuantizationType[kind])  # the gguf package's reading
    # Each within what its range quantizer can promise: half a step of its sub-block's range.
    bound = {"Q5_K": 0.006, "Q3_K": 0.03, "Q2_K": 0.05, "IQ4_NL": 0.02}[kind]
    assert np.abs(back - w).max() < bound


def test_fused_4_bit_parts_stay_4_bit_where_their_values_agree():
    def fused(*kinds: str) -> tuple[int, int | None, bool]:
        types = {f"model.layers.0.self_attn.{p}_proj": [f"blk.0.attn_{p}.weight", k] for p, k in zip("qkv", kinds, strict=True)}
        s = gguf_quant({"gguf_file": "x.gguf", "tensor_types": types}).fused_scheme(list(types))
        assert s is not None
        return s.bits, s.group, s.minimum

    assert fused("Q4_0", "Q4_0", "Q3_K") == (4, 16, False)  # values in [-8, 7] for all
    assert fused("Q4_K", "Q4_1", "Q2_K") == (4, 16, True)  # values in [0, 15] for all, minimums
    assert fused("Q4_K", "Q4_K", "Q4_0") == (8, 32, True)  # a minimum beside none: 8-bit containers
    assert fused("Q5_0", "Q5_0", "Q8_0") == (8, 32, False)  # Q4_K_M's fallbacks (Q6_K -> Q8_0)
    assert SCHEMES["Q4_1"] == SCHEMES["Q4_K"]


def _check(path: Path, config: object = None) -> list[QuantLinear]:
    logits, runner = prompt_logits(gguf_view(path), PROMPT, 64)
    with torch.inference_mode():
        want = gf.reference(path, config)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=2e-5)  # float32 rounding
    assert logits.argmax(-1).tolist() == want.argmax(-1).tolist()
    quant = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert all(m.weight.is_meta and m.qweight.dtype == torch.int8 for m in quant)  # no float copy
    return quant


@pytest.mark.parametrize("kind", NEW)
def test_every_position_matches_transformers_in_each_new_type(tmp_path, kind, vocab, demo_path):
    model = gf.tiny_model("llama", vocab)
    path = gf.write_gguf(model, tmp_path / "m.gguf", "llama", gf.every(kind, embedding=kind), demo_path)
    quant = _check(path)
    bits, group, minimum, _ = _SCHEME[kind]
    assert len(quant) == 9 and {(m.scheme.bits, m.group, m.scheme.minimum) for m in quant} == {(bits, group, minimum)}


@pytest.mark.parametrize(("main", "hidden", "arch"), [("Q4_K", 224, "llama"), ("Q5_K", 224, "qwen2"),
                                                      ("Q5_K", 256, "llama")])
def test_k_quant_mixes_with_llama_quantizes_fallbacks(tmp_path, main, hidden, arch, vocab, demo_path):
    # Rows of 224 (not a multiple of 256) are what a real Q4_K_M / Q5_K_M of such a model holds:
    # q/k/o/gate/up and the embedding in Q5_0 (Q5_1 for Q5_K), v and the output in Q8_0, and
    # ffn_down (rows of 512) in Q6_K. Q5_K_M at 256: Q5_K beside Q6_K, fused v included.
    model = gf.tiny_model(arch, vocab, hidden_size=hidden)
    rule = gf.k_mix(main, gf.row_lengths(model, arch))
    path = gf.write_gguf(model, tmp_path / "m.gguf", arch, rule, demo_path)
    quant = _check(path)
    view = json.loads((gguf_view(path) / "config.json").read_text())["quantization_config"]["tensor_types"]
    kinds = {k for _, k in view.values()}
    if hidden == 224:
        assert kinds == {gf.FALLBACK[main], "Q8_0", "Q6_K"}
    else:
        assert kinds == {"Q5_K", "Q6_K"}
    qkv = [m for m in quant if m.out_features == hidden + 2 * (hidden // 4) * 2]
    assert qkv and all(m.scheme.bits == 8 for m in qkv)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("kind", ["Q4_1", "Q3_K", "Q2_K", "Q5_0", "Q5_K", "IQ4_NL"])
def test_each_new_type_on_int8_activations(tmp_path, monkeypatch, kind, vocab, demo_path):
    # The CPU's default: 4-bit containers on W4A8, 8-bit ones on W8A8g, activations rounded to
    # int8 per group of the weights' group; each layer on the inputs it sees, and the logits
    # within the rounding's own reach (tests/quant_checks.py).
    _, group, _, op = _SCHEME[kind]
    on_int8_activations(tmp_path, monkeypatch, gf.every(kind), vocab, demo_path, op, group)


# -- refusals ------------------------------------------------------------------------------------


def _patch_tensor_header(path: Path, name: str, edit: object) -> None:
    """The tensor info of `name` in the file's header (name, n_dims, dims as u64, type, offset),
    its dims passed through `edit`."""
    data = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    n = int.from_bytes(data[at:at + 4], "little")
    dims = [int.from_bytes(data[at + 4 + 8 * i:at + 12 + 8 * i], "little") for i in range(n)]
    for i, d in enumerate(edit(dims)):  # type: ignore[operator]
        data[at + 4 + 8 * i:at + 12 + 8 * i] = d.to_bytes(8, "little")
    path.write_bytes(bytes(data))


def test_rows_that_are_not_whole_blocks_are_refused_naming_the_tensor(tmp_path, vocab, demo_path):
    # A row length that is not a multiple of the block would cut every later row (and its
    # scales) at the wrong byte; the header says so before a tensor is read.
    model = gf.tiny_model("llama", vocab)
    path = gf.write_gguf(model, tmp_path / "m.gguf", "llama", gf.every("Q5_0"), demo_path)
    _patch_tensor_header(path, "blk.1.ffn_down.weight", lambda dims: [dims[0] - 16, dims[1]])
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.ffn_down\.weight has rows of 496 values, not a "
                                              r"multiple of Q5_0's block of 32"):
        gguf_view(path)


def test_a_scale_that_is_not_finite_is_refused_naming_the_tensor(tmp_path, vocab, demo_path):
    model = gf.tiny_model("llama", vocab)
    path = gf.write_gguf(model, tmp_path / "m.gguf", "llama", gf.every("Q5_1"), demo_path)
    reader_offset = _tensor_offset(path, "blk.0.attn_output.weight")
    data = bytearray(path.read_bytes())
    data[reader_offset + 24 * 5:reader_offset + 24 * 5 + 2] = np.array([np.inf], np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.0\.attn_output\.weight \(Q5_1\) has a scale or "
                                         "minimum that is not finite"):
        prompt_logits(gguf_view(path), PROMPT, 16)


def _tensor_offset(path: Path, name: str) -> int:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return int(t.data_offset)
