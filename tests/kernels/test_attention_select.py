"""The worker's start-up choice of attention backend (worker/attention_select.py): per layer,
the kernels where they are built for the shapes, dtype and block size, torch elsewhere, with
one log line; a missing or broken CuPy falls back to torch with one line naming the install
command. The CPU emulator stands in for CuPy where kernels must really run."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_kernel_ops_api import Recorder

from noria.kernels.attention_backend import KernelAttentionBackend
from noria.kernels.instances import ModuleSpec
from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend
from noria.worker.attention_select import CUDA_INSTALL_HINT, get_attention_backend
from noria.worker.errors import WorkerFatal

BUILT = LayerAttention(4, 2, 32, 0.2)  # the demo model's head size
ODD_HEAD = LayerAttention(4, 2, 16, 0.25)  # head size 16: no instance
WINDOWED = LayerAttention(4, 2, 32, 0.2, sliding_window=8)
CAPPED = LayerAttention(4, 2, 32, 0.2, sliding_window=5, logits_soft_cap=1.5)  # Gemma 2's local layers
UNEVEN = LayerAttention(6, 4, 32, 0.2)  # 6 query heads over 4 KV heads
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # CUDA: only named, never used


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return []  # the warm-up compiles (or finds cached) what it needs itself


class Counting(Recorder):
    """Records launches and compiles (kernel lookups) without running anything."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[str] = []

    def kernel(self, spec: ModuleSpec, name: str) -> Any:
        self.compiled.append(name)
        return super().kernel(spec, name)


def select(caplog: pytest.LogCaptureFixture, device: torch.device, layers: Sequence[LayerAttention],
           dtype: torch.dtype = torch.float32, block_size: int = 16, **kw: Any) -> tuple[Any, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="noria.worker"):
        backend = get_attention_backend(device, layers, dtype, block_size, **kw)
    return backend, [r.getMessage() for r in caplog.records if r.name == "noria.worker"]


def test_cpu_without_kernels_is_torch_and_silent(caplog: pytest.LogCaptureFixture) -> None:
    backend, lines = select(caplog, CPU, [BUILT])
    assert isinstance(backend, TorchAttentionBackend) and lines == []


def test_per_layer_decision_and_one_line(caplog: pytest.LogCaptureFixture) -> None:
    rec = Counting()
    backend, lines = select(caplog, CPU, [BUILT, ODD_HEAD, WINDOWED, UNEVEN, CAPPED], kernel_backend=rec)
    assert isinstance(backend, KernelAttentionBackend)
    assert len(lines) == 1, lines
    assert "kernels for 3 of 5 layers" in lines[0]
    assert "1: head size 16" in lines[0] and "3: 6 query heads do not group evenly" in lines[0]
    assert "window" not in lines[0]  # sliding-window and soft-capped layers run on the kernels
    # Start-up compiled exactly the head size that runs on kernels, nothing at step time.
    assert any("32, 16>" in n for n in rec.compiled) and not any(", 16, " in n for n in rec.compiled)
    assert backend.supports(BUILT, torch.float32, 16)
    assert not backend.supports(BUILT, torch.float32, 24)
    assert not backend.supports(BUILT, torch.float64, 16)
    assert not backend.supports(ODD_HEAD, torch.float32, 16)


def test_fp8_cache_runs_on_the_kernels_where_they_have_instances(caplog: pytest.LogCaptureFixture) -> None:
    """--kv-cache-dtype fp8: layers with fp8 instances (16-bit model, head size 64 / 128) run on
    the kernels, which compile their fp8 cache write and attention; others go to torch with the
    reason in the one line; --attention-backend kernels runs rather than refusing."""
    fp8 = torch.float8_e4m3fn
    scaled = LayerAttention(4, 2, 64, 0.125, k_scale=0.5, v_scale=0.25)
    rec = Counting()
    backend, lines = select(caplog, CPU, [scaled, BUILT], torch.bfloat16, kernel_backend=rec, choice="kernels",
                            kv_dtype=fp8)
    assert isinstance(backend, KernelAttentionBackend) and backend.kv_dtype == fp8
    assert len(lines) == 1 and "kernels for 1 of 2 layers" in lines[0]
    assert "1: head size 32 with an fp8 KV cache (kernels: 64, 128)" in lines[0]
    assert any(n.startswith("paged_attention_decode_gqa<__nv_bfloat16, 64, 16, unsigned char>") for n in rec.compiled)
    assert any(n.startswith("reshape_and_cache<__nv_bfloat16, long long, unsigned char>") for n in rec.compiled)
    assert any(n.startswith("rotary_qkv_cache<__nv_bfloat16, long long, unsigned char>") for n in rec.compiled)
    assert backend.supports(scaled, torch.bfloat16, 16) and not backend.supports(BUILT, torch.bfloat16, 16)
    assert not backend.supports(scaled, torch.bfloat16, 64)  # block size 64: no fp8 instance
    # A float32 model's layers have none: auto is torch with the reason, kernels refuses in one sentence.
    backend, lines = select(caplog, CPU, [scaled], torch.float32, kernel_backend=Counting(), kv_dtype=fp8)
    assert isinstance(backend, TorchAttentionBackend)
    assert lines == ["attention: torch backend for every layer: 0: float32 queries over an fp8 KV cache "
                     "(kernels: float16, bfloat16)"]
    with pytest.raises(WorkerFatal, match="--attention-backend kernels: no layer") as e:
        select(caplog, CPU, [scaled], torch.float32, kernel_backend=Counting(), choice="kernels", kv_dtype=fp8)
    assert "\n" not in str(e.value)


def test_every_layer_unsupported_is_torch(caplog: pytest.LogCaptureFixture) -> None:
    backend, lines = select(caplog, CPU, [ODD_HEAD, ODD_HEAD], kernel_backend=Counting())
    assert isinstance(backend, TorchAttentionBackend)
    assert lines == ["attention: torch backend for every layer: 0, 1: head size 16 "
                     "(kernels: 32, 64, 80, 96, 128, 256)"]


def test_missing_cupy_falls_back_with_install_hint(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    backend, lines = select(caplog, CUDA, [BUILT])
    assert isinstance(backend, TorchAttentionBackend)
    assert len(lines) == 1 and "CuPy is not installed" in lines[0] and CUDA_INSTALL_HINT in lines[0], lines


def test_broken_cupy_falls_back_with_install_hint(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_driver() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    runtime = types.SimpleNamespace(getDeviceCount=no_driver)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    backend, lines = select(caplog, CUDA, [BUILT])
    assert isinstance(backend, TorchAttentionBackend)
    assert len(lines) == 1 and "InsufficientDriver" in lines[0] and CUDA_INSTALL_HINT in lines[0]
    assert "does not work here" in lines[0]


def test_compile_failure_at_start_up_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    class NoNvrtc(Counting):
        def kernel(self, spec: ModuleSpec, name: str) -> Any:
            raise OSError("libnvrtc.so.13: cannot open shared object file")

    backend, lines = select(caplog, CPU, [BUILT], kernel_backend=NoNvrtc())
    assert isinstance(backend, TorchAttentionBackend)
    assert len(lines) == 1 and "libnvrtc" in lines[0] and CUDA_INSTALL_HINT in lines[0]


def _meta(block_size: int, seq_len: int) -> AttentionMetadata:
    blocks = -(-seq_len // block_size)
    return AttentionMetadata(
        positions=torch.arange(seq_len),
        slot_mapping=torch.arange(seq_len),
        query_start_loc=torch.tensor([0, seq_len]),
        seq_lens=torch.tensor([seq_len]),
        block_tables=torch.arange(blocks)[None, :],
        block_size=block_size,
        query_lens_host=[seq_len],
        seq_lens_host=[seq_len],
        query_start_host=[0, seq_len],
    )


def _layer_io(layer: LayerAttention, seq_len: int, block_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(layer.head_dim)
    q = torch.randn(seq_len, layer.num_heads, layer.head_dim, generator=g)
    k = torch.randn(seq_len, layer.num_kv_heads, layer.head_dim, generator=g)
    v = torch.randn(seq_len, layer.num_kv_heads, layer.head_dim, generator=g)
    shape = (-(-seq_len // block_size) + 1, block_size, layer.num_kv_heads, layer.head_dim)
    return q, k, v, torch.zeros(shape), torch.zeros(shape)


@pytest.mark.parametrize("layer", [BUILT, ODD_HEAD, WINDOWED, CAPPED], ids=["d32", "d16", "window", "soft-cap"])
def test_layers_run_where_decided_and_match_torch(emu: Any, layer: LayerAttention) -> None:
    """Under the emulator: a built layer runs on the kernels (with its sliding window and logit
    soft-cap), the others on torch, and every layer's output equals the torch backend's."""
    bs, n = 8, 13
    backend = get_attention_backend(CPU, [layer], torch.float32, bs, kernel_backend=emu("forward"))
    torch_backend = TorchAttentionBackend(native=False)
    outs = []
    for b in (backend, torch_backend):
        meta = _meta(bs, n)
        b.prepare(meta)
        outs.append(b.forward(layer, *_layer_io(layer, n, bs), meta))
    torch.testing.assert_close(outs[0], outs[1], atol=3e-5, rtol=3e-5)
    assert isinstance(backend, KernelAttentionBackend) == (layer is not ODD_HEAD)


def test_no_unbuilt_shape_reaches_a_kernel() -> None:
    """Without a fallback an unsupported layer is an error naming why, before any launch."""
    rec = Recorder()
    kernels = KernelAttentionBackend(fallback=None, backend=rec)
    meta = _meta(8, 5)
    kernels.prepare(meta)
    with pytest.raises(NotImplementedError, match="head size 16"):
        kernels.forward(ODD_HEAD, *_layer_io(ODD_HEAD, 5, 8), meta)
    assert rec.launches == []
    kernels.forward(BUILT, *_layer_io(BUILT, 5, 8), meta)
    assert [x["name"].split("<")[0] for x in rec.launches] == ["reshape_and_cache", "paged_attention_prefill"]

