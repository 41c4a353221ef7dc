"""bfloat16 on the CPU: the linear weights kept in bf16 (the native bf16-weight GEMM), activations
and KV cache in float32 (worker/device.py, `cpu_precision`).

The reference is exact: the same engine in float32 on a checkpoint whose weights are already
bf16-rounded computes the same numbers, since the bf16 GEMM is the float32 GEMM's in-order sum
over the bf16-rounded weight (tests/test_worker_gemm_bf16.py). So hidden states and the KV the
step writes are compared bit for bit, through the native decoder stack and the Python path,
for a dense family, one with per-head q/k norms, Gemma's and a mixture of experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noria.protocol.config import EngineConfig
from noria.worker import gemm_bf16_kernels, native_stack
from noria.worker.model_runner import ModelRunner
from noria.worker.models.linear import Linear, PackedBF16Linear
from tests.test_worker_native_stack import STEPS, _forward
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(gemm_bf16_kernels.load() is None or native_stack.load() is None,
                                reason="no C compiler for the native kernels")


def _rounded(arch: str, path: Path) -> Path:
    """A float32 checkpoint whose every weight is bf16-representable."""
    make_checkpoint(arch, path, tied=arch == "gemma2")
    for file in path.glob("*.safetensors"):
        weights = {k: v.to(torch.bfloat16).float() for k, v in load_file(file).items()}
        save_file(weights, file, metadata={"format": "pt"})
    return path


def _runner(path: Path, dtype: str) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=str(path), dtype=dtype, device="cpu", num_kv_blocks=128,
                                      swap_space=0.001, num_threads=2))
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)  # contexts the steps attend to
    return runner


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_bf16_weights_compute_the_float32_model_of_the_rounded_weights(arch: str, tmp_path: Path) -> None:
    path = _rounded(arch, tmp_path / arch)
    f32, bf16 = _runner(path, "float32"), _runner(path, "bfloat16")
    assert (bf16.dtype, bf16.weight_dtype) == (torch.float32, torch.bfloat16)
    assert bf16.kv_cache.device_cache.dtype == torch.float32
    linears = [m for m in bf16.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.op, PackedBF16Linear) and m.weight.dtype == torch.bfloat16 for m in linears)
    assert isinstance(bf16.model.head, PackedBF16Linear)
    layers = len(bf16.model.layers)
    assert native_stack.coverage(bf16.model, bf16._kv_layers) == [None] * layers
    for name, step in STEPS.items():
        want, _ = _forward(f32, step, native=True)
        native, ran = _forward(bf16, step, native=True)
        python, _ = _forward(bf16, step, native=False)
        assert ran == (name != "long prompt"), name
        assert torch.equal(native, want), f"{arch}, {name}: bf16 weights differ from float32 on the rounded weights"
        assert torch.equal(python, native), f"{arch}, {name}: the Python path differs from the native stack"
    hidden = torch.randn(3, bf16.spec.hidden_size)
    assert torch.equal(bf16.model.compute_logits(hidden), f32.model.compute_logits(hidden))


def test_weight_bytes_halve(tmp_path: Path) -> None:
    path = _rounded("llama", tmp_path / "llama")
    f32, bf16 = _runner(path, "float32"), _runner(path, "bfloat16")

    def linear_bytes(runner: ModelRunner) -> int:
        return sum(m.weight.numel() * m.weight.element_size() for m in runner.model.modules() if isinstance(m, Linear))

    assert linear_bytes(bf16) * 2 == linear_bytes(f32)
