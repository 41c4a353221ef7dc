"""The CPU linear layer: the native GEMM's packed weights and F.linear against a float64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noria.worker import gemm_kernels
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.loader import load_model, load_spec
from noria.worker.models.linear import PackedLinear, TorchLinear, linear_op
from tests.tiny_models import make_checkpoint


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 17, 64, 65, 130, 256, 257, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_reference(rows: int, with_bias: bool) -> None:
    """Both paths of the CPU GEMM family: native (packed) and torch (F.linear, packed None)."""
    torch.manual_seed(rows)
    weight = torch.randn(96, 80) * 0.1
    bias = torch.randn(96) if with_bias else None
    x = torch.randn(rows, 80)
    if not gemm_kernels.usable(weight):
        pytest.skip("no C compiler: the native GEMM is not built")
    packed = linear_op(weight)
    assert isinstance(packed, PackedLinear) and isinstance(packed.packed, PackedWeight)
    want = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    for got in (packed(x, bias), TorchLinear(weight)(x, bias)):
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_packing_applies_only_to_cpu_float32() -> None:
    assert isinstance(linear_op(torch.randn(8, 8, dtype=torch.bfloat16)), TorchLinear)
    assert isinstance(linear_op(torch.randn(8, 8, dtype=torch.float64)), TorchLinear)


@pytest.mark.parametrize("tied", [False, True])
def test_loaded_model_uses_packed_weights_and_they_hold_the_checkpoint(tied: bool, tmp_path: Path) -> None:
    """The parity tests run through the packed path, so it must be switched on
    by loading; and each packed copy must compute with the loaded weight."""
    if gemm_kernels.load() is None:
        pytest.skip("no C compiler: the native GEMM is not built")
    path = make_checkpoint("llama", tmp_path / "m", tied=tied, seed=5)
    model = load_model(path, load_spec(path), torch.device("cpu"), torch.float32)
    x = torch.randn(7, model.spec.hidden_size)
    attn, mlp = model.layers[0].self_attn, model.layers[-1].mlp
    last = len(model.layers) - 1
    file = load_file(path / "model.safetensors")
    head = file["model.embed_tokens.weight" if tied else "lm_head.weight"]
    pairs = [
        (torch.cat([file[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]), attn.qkv_proj.op),
        (torch.cat([file[f"model.layers.{last}.mlp.{n}_proj.weight"] for n in ("gate", "up")]), mlp.gate_up_proj.op),
        (head, model.head),
    ]
    for weight, op in pairs:
        assert isinstance(op, PackedLinear)
        assert torch.equal(op.packed.unpack(), weight)
        torch.testing.assert_close(op(x, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    # The panels are the only copy of a packed weight the model keeps.
    assert attn.qkv_proj.weight.is_meta and mlp.gate_up_proj.weight.is_meta
    hidden = torch.randn(4, model.spec.hidden_size)
    unpacked = torch.nn.functional.linear(hidden, head)
    torch.testing.assert_close(model.compute_logits(hidden), unpacked, rtol=1e-5, atol=1e-5)
