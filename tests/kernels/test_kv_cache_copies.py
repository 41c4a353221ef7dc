"""Swap-out and swap-in through the copy_blocks kernel (KVCache.block_copier), run by the CPU
emulator: exact block contents for every layer's K and V in one launch per call, and the
worker's swap-preemption scenario (tests/test_worker_swap.py) with attention and block copies
on the emulated kernels, against transformers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.test_worker_swap as swap_tests
from noria.kernels import instances, ops
from noria.kernels.attention_backend import KernelAttentionBackend
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.worker import model_runner
from noria.worker.attention import TorchAttentionBackend
from noria.worker.attention_select import AttentionChoice
from noria.worker.kv_cache import KVCache
from noria.worker.model_runner import ModelRunner
from tests.test_worker_swap import check_swaps_exact
from tests.tiny_models import make_checkpoint

# head_dim 64 (hidden 256 over 4 heads): attention runs on the kernels too.
OVERRIDES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    cfg = AttentionConfig("float32", 64, 16)
    return [instances.copy_module(), instances.reshape_module("float32"), instances.decode_module(cfg),
            instances.prefill_module(cfg)]


class CountingCopier:
    """ops.copy_blocks on a given backend, recording each launch's mapping."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[tuple[int, list[list[int]]]] = []

    def __call__(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], mapping: torch.Tensor) -> None:
        self.calls.append((len(src), mapping.tolist()))
        ops.copy_blocks(src, dst, mapping, backend=self.backend)


def _cache(emu: Callable[[str], Any], dtype: torch.dtype) -> tuple[KVCache, CountingCopier]:
    cache = swap_tests._filled_cache(dtype)
    copier = CountingCopier(emu("forward"))
    cache.block_copier = copier
    return cache, copier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_copies_preserve_blocks_exactly(emu: Any, dtype: torch.dtype) -> None:
    """The same exact-content checks as the torch path's test, through the kernel."""
    cache, copier = _cache(emu, dtype)
    check_swaps_exact(cache)
    # One launch per call, over 3 layers x (K, V); swap-in maps CPU block -> device block.
    assert copier.calls == [(6, [[1, 0], [3, 5]]), (6, [[0, 9], [5, 6]])]


@pytest.fixture(scope="module")
def qwen2_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2", seed=5, **OVERRIDES)


@pytest.fixture
def kernel_runners(emu: Any, monkeypatch: pytest.MonkeyPatch) -> list[CountingCopier]:
    """Makes test_worker_swap's runners use the emulated kernels for attention and copies."""
    made: list[CountingCopier] = []
    plain = swap_tests._runner

    def runner(path: Path) -> ModelRunner:
        r = plain(path)
        r.use_attention(KernelAttentionBackend(fallback=TorchAttentionBackend(), backend=emu("greedy-reverse")))
        copier = CountingCopier(emu("greedy-reverse"))
        r.kv_cache.block_copier = copier
        made.append(copier)
        return r

    monkeypatch.setattr(swap_tests, "_runner", runner)
    return made


def test_swap_preemption_on_kernels(qwen2_d64: Path, kernel_runners: list[CountingCopier]) -> None:
    swap_tests.test_swap_preemption_matches_transformers(qwen2_d64)
    [copier] = kernel_runners
    assert [m for _, m in copier.calls] == [[[0, 4], [1, 0], [2, 2]], [[4, 7], [0, 5], [2, 9]]]


def test_model_runner_wires_the_kernel_copier(
    qwen2_d64: Path, emu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swaps go through the kernel exactly when the start-up choice is the kernel backend."""
    assert swap_tests._runner(qwen2_d64).kv_cache.block_copier is None  # CPU: torch attention
    kernels = KernelAttentionBackend(fallback=TorchAttentionBackend(), backend=emu("forward"))
    monkeypatch.setattr(model_runner, "select_attention_backend",
                        lambda *args, **kw: AttentionChoice(kernels, "kernels"))
    runner = swap_tests._runner(qwen2_d64)
    assert runner.attention is kernels
    assert runner.kv_cache.block_copier == kernels.copy_blocks
