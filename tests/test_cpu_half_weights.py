"""bfloat16 and float16 on the CPU: the linear weights kept in 16 bits (the native GEMM over them)
and the KV cache in that dtype, activations in float32 (worker/device.py `cpu_precision`,
ModelRunner.kv_dtype).

The reference is exact: the same engine in float32 on a checkpoint whose weights are already
rounded to the dtype, its KV cache one of that dtype (rows rounded as written, widened as read),
computes the same numbers where the GEMM widens the weights (float16 always; bfloat16 with
$NORIA_CPU_BF16_WIDEN=1, as AVX512_BF16's dot products round the activations too): each output
is then the float32 GEMM's in-order sum over the rounded weight (tests/test_worker_gemm_bf16.py). So hidden states and the KV the step
writes are compared bit for bit, through the native decoder stack and the Python path, for a
dense family, one with per-head q/k norms, Gemma's and a mixture of experts. (The stack against
the Python path under the host's default bf16 GEMM: tests/test_worker_native_stack.py.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noria.protocol.config import EngineConfig
from noria.worker import gemm_bf16_kernels, native_stack
from noria.worker.kv_cache import KVCache
from noria.worker.model_runner import ModelRunner
from noria.worker.models.linear import Linear, PackedHalfLinear, packed
from tests.test_worker_native_stack import STEPS, _forward
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(gemm_bf16_kernels.load() is None or native_stack.load() is None,
                                reason="no C compiler for the native kernels")


def _rounded(arch: str, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A float32 checkpoint whose every weight is representable in `dtype`."""
    make_checkpoint(arch, path, tied=arch == "gemma2")
    for file in path.glob("*.safetensors"):
        weights = {k: v.to(dtype).float() for k, v in load_file(file).items()}
        save_file(weights, file, metadata={"format": "pt"})
    return path


def _runner(path: Path, dtype: str, kv_dtype: torch.dtype | None = None, num_kv_blocks: int | None = 128,
            kv_cache_memory: float | None = None) -> ModelRunner:
    """`kv_dtype`: the runner's KV cache replaced by one of that dtype, before anything reads it."""
    runner = ModelRunner(EngineConfig(model=str(path), dtype=dtype, device="cpu", num_kv_blocks=num_kv_blocks,
                                      kv_cache_memory=kv_cache_memory, swap_space=0.001, num_threads=2))
    if kv_dtype is not None:
        old = runner.kv_cache
        layout = dataclasses.replace(old.layout, dtype=kv_dtype)
        runner.kv_cache = KVCache(layout, old.num_blocks, old.num_cpu_blocks, runner.device)
        runner._kv_layers = [runner.kv_cache.layer(i) for i in range(layout.num_layers)]
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)  # contexts the steps attend to (the same in every runner)
    return runner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_half_weights_compute_the_float32_model_of_the_rounded_weights(
        arch: str, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NORIA_CPU_BF16_WIDEN", "1")  # float32 activations into every GEMM
    path = _rounded(arch, tmp_path / arch, dtype)
    f32, half = _runner(path, "float32", kv_dtype=dtype), _runner(path, str(dtype).removeprefix("torch."))
    plain = _runner(path, "float32")
    assert (half.dtype, half.weight_dtype, half.kv_dtype) == (torch.float32, dtype, dtype)
    assert half.kv_cache.device_cache.dtype == half.kv_cache.cpu_cache.dtype == dtype
    assert plain.kv_cache.device_cache.dtype == torch.float32
    linears = [m for m in half.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.op, PackedHalfLinear) and m.weight.dtype == dtype for m in linears)
    assert isinstance(half.model.head, PackedHalfLinear)
    layers = len(half.model.layers)
    assert native_stack.coverage(half.model, half._kv_layers) == [None] * layers
    for name, step in STEPS.items():
        want, _ = _forward(f32, step, native=True)
        native, ran = _forward(half, step, native=True)
        python, _ = _forward(half, step, native=False)
        assert ran == (name != "long prompt"), name
        assert torch.equal(native, want), f"{arch}, {name}: 16-bit weights and KV differ from float32 on rounded ones"
        assert torch.equal(python, native), f"{arch}, {name}: the Python path differs from the native stack"
        # A float32 cache holds other contexts and the step's rows unrounded: not these numbers.
        unrounded, _ = _forward(plain, step, native=True)
        assert not torch.equal(unrounded, want), f"{arch}, {name}"
    hidden = torch.randn(3, half.spec.hidden_size)
    assert torch.equal(half.model.compute_logits(hidden), f32.model.compute_logits(hidden))


def test_the_bf16_kv_cache_holds_twice_the_blocks(tmp_path: Path) -> None:
    """Sized from --kv-cache-memory, a bf16 cache (float32 activations) fits twice float32's blocks,
    and the CPU swap area is bf16 too."""
    path = _rounded("llama", tmp_path / "llama")
    f32 = _runner(path, "float32", num_kv_blocks=None, kv_cache_memory=0.01)
    bf16 = _runner(path, "bfloat16", num_kv_blocks=None, kv_cache_memory=0.01)
    assert bf16.kv_cache.layout.bytes_per_block * 2 == f32.kv_cache.layout.bytes_per_block
    assert 0 < 2 * f32.num_kv_blocks <= bf16.num_kv_blocks <= 2 * f32.num_kv_blocks + 1  # whole blocks each
    assert bf16.kv_cache.cpu_cache.dtype == torch.bfloat16
    assert bf16.kv_cache.device_cache.numel() * 2 == bf16.kv_cache.device_cache.nbytes


def test_weight_bytes_halve(tmp_path: Path) -> None:
    path = _rounded("llama", tmp_path / "llama")
    f32, bf16 = _runner(path, "float32"), _runner(path, "bfloat16")

    def linear_bytes(runner: ModelRunner) -> int:
        """The bytes every linear layer holds: its panels, its parameter only where it has bytes."""
        held = 0
        for m in runner.model.modules():
            if isinstance(m, Linear):
                held += 0 if m.weight.is_meta else m.weight.nbytes
                held += 0 if packed(m.op) is None else packed(m.op).data.nbytes  # type: ignore[union-attr]
        return held

    # Panels pad N to whole panels (and the dot layout K to even): about half, not exactly.
    assert 0.45 < linear_bytes(bf16) / linear_bytes(f32) <= 0.55
    # The embedding table too, its rows widened as they are looked up.
    assert bf16.model.embed_tokens.dtype == torch.bfloat16 and f32.model.embed_tokens.dtype == torch.float32
    assert bf16.model.embed_tokens.nbytes * 2 == f32.model.embed_tokens.nbytes


def test_where_amx_is_ready_the_model_multiplies_on_tiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "amx" layout end to end, on the real tiles where the CPU has AMX and on their emulation
    elsewhere: every linear kind and the native stack's GEMM take it, and the steps agree with
    the dot kernel's (NORIA_CPU_NO_AMX=1) within bf16's error (another summation order)."""
    from noria.worker import gemm_amx_kernels

    if gemm_bf16_kernels.layout() not in ("dot", "amx") or gemm_amx_kernels.load(True) is None:
        pytest.skip("the AMX layout reuses the dot layout's panels (AVX512_BF16 hosts)")
    real = gemm_bf16_kernels.layout() == "amx"
    path = _rounded("qwen3_moe", tmp_path / "m")
    monkeypatch.setenv("NORIA_CPU_NO_AMX", "1")
    assert gemm_bf16_kernels.layout() == "dot"
    dot = _runner(path, "bfloat16")
    monkeypatch.delenv("NORIA_CPU_NO_AMX")
    if not real:
        monkeypatch.setattr(gemm_amx_kernels, "ready", lambda: True)
        monkeypatch.setattr(gemm_amx_kernels, "entry", lambda emulate=False: gemm_amx_kernels.load(True).gemm_amx)
    assert gemm_bf16_kernels.layout() == "amx"
    amx = _runner(path, "bfloat16")
    kinds = {packed(m.op).kind for m in amx.model.modules() if isinstance(m, Linear)}  # type: ignore[union-attr]
    assert kinds == {"amx"}
    qkv = amx.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, packed(qkv.op).k)  # type: ignore[union-attr]
    assert torch.equal(qkv(x), gemm_amx_kernels.gemm_amx(x, packed(qkv.op), qkv.bias, emulate=not real))  # type: ignore[arg-type]
    assert native_stack.coverage(amx.model, amx._kv_layers) == [None] * len(amx.model.layers)
    for name, step in STEPS.items():
        want, _ = _forward(dot, step, native=True)
        got, ran = _forward(amx, step, native=True)
        assert ran == (name != "long prompt"), name
        assert (got - want).norm() <= 2e-2 * want.norm(), name
