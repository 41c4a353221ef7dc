"""Swaps: exact contents in KVCache, and end to end in ModelRunner."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.kv_cache import KVCache, KVLayout
from noria.worker.model_runner import ModelRunner
from tests.tiny_models import load_reference, make_checkpoint, reference_greedy

GREEDY = EngineSamplingParams(temperature=0.0)


def _filled_cache(dtype: torch.dtype) -> KVCache:
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    cache = KVCache(layout, num_blocks=10, num_cpu_blocks=6, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.device_cache[:, :, :10] = torch.randn(cache.device_cache[:, :, :10].shape, generator=g).to(dtype)
    cache.cpu_cache.copy_(torch.randn(cache.cpu_cache.shape, generator=g).to(dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swaps_preserve_blocks_exactly(dtype: torch.dtype) -> None:
    check_swaps_exact(_filled_cache(dtype))


def check_swaps_exact(cache: KVCache) -> None:
    """Swap out, swap back into other blocks: every block's bytes land where planned
    (also run on the kernel path: tests/kernels/test_kv_cache_copies.py)."""
    dev0, cpu0 = cache.device_cache.clone(), cache.cpu_cache.clone()

    cache.swap_out([(1, 0), (3, 5)])
    assert torch.equal(cache.cpu_cache[:, :, 0], dev0[:, :, 1])  # every layer, K and V
    assert torch.equal(cache.cpu_cache[:, :, 5], dev0[:, :, 3])
    assert torch.equal(cache.cpu_cache[:, :, 1:5], cpu0[:, :, 1:5])
    assert torch.equal(cache.device_cache, dev0)

    # Swap back into other device blocks (the originals may have been reused).
    cache.device_cache[:, :, 1] = 0
    cache.device_cache[:, :, 3] = 0
    cache.swap_in([(9, 0), (6, 5)])
    assert torch.equal(cache.device_cache[:, :, 9], dev0[:, :, 1])
    assert torch.equal(cache.device_cache[:, :, 6], dev0[:, :, 3])
    for b in (0, 2, 4, 5, 7, 8):
        assert torch.equal(cache.device_cache[:, :, b], dev0[:, :, b])
    # The per-layer views the model uses see the same memory.
    k, v = cache.layer(2)
    assert torch.equal(k[9], dev0[2, 0, 1]) and torch.equal(v[9], dev0[2, 1, 1])


def test_bad_block_ids_are_rejected() -> None:
    cache = _filled_cache(torch.float32)
    with pytest.raises(ValueError, match="block id out of range"):
        cache.swap_out([(10, 0)])  # 10 is the null block: never the scheduler's
    with pytest.raises(ValueError, match="CPU block id out of range"):
        cache.swap_out([(1, 6)])
    with pytest.raises(ValueError, match="block id out of range"):
        cache.swap_in([(-1, 0)])


def _resident_pages(t: torch.Tensor) -> torch.Tensor:
    """mincore(2) over the tensor's own pages: whether each is in memory. (The process's RSS
    delta is not a measure of this: the allocator may hand back pages that were resident.)"""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return torch.tensor(list(vec), dtype=torch.uint8) & 1 == 1


def test_device_cache_is_zeroed_and_committed_at_start() -> None:
    """Every block, the null block too, reads zeros from the start, and its pages are
    resident before any request: a block's first use costs no page faults mid-serving."""
    layout = KVLayout(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = KVCache(layout, num_blocks=767, num_cpu_blocks=1, device=torch.device("cpu"))
    resident = _resident_pages(cache.device_cache)  # read before anything below touches the cache
    size = cache.device_cache.numel() * cache.device_cache.element_size()
    assert size == 768 * layout.bytes_per_block
    assert resident.all(), f"{int((~resident).sum())} of {resident.numel()} pages not resident"
    assert not cache.device_cache.any()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2", seed=5)


def _runner(path: Path, dtype: str = "auto") -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), num_kv_blocks=16, swap_space=0.001, num_threads=2,
                                    preemption_mode="swap", dtype=dtype))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_swap_preemption_matches_transformers(qwen2: Path) -> None:
    """A is swapped out mid-decode, its device blocks are overwritten by B, and
    it comes back in different blocks; its output is unchanged."""
    ref = load_reference(qwen2)
    (pa, out_a), (pb, out_b) = _swap_scenario(_runner(qwen2))
    assert out_a == reference_greedy(ref, pa, len(out_a))
    assert out_b == reference_greedy(ref, pb, len(out_b))


def test_swap_preemption_with_a_bf16_kv_cache(qwen2: Path) -> None:
    """The CPU's bf16 mode swaps its bf16 KV blocks (a bf16 swap area): the preempted and resumed
    request continues as the same engine continues it unpreempted, alone."""
    runner = _runner(qwen2, "bfloat16")
    if runner.weight_dtype is None:
        pytest.skip("no native bf16 GEMM here: bfloat16 runs on torch's operators, KV cache included")
    assert runner.kv_cache.device_cache.dtype == runner.kv_cache.cpu_cache.dtype == torch.bfloat16
    (pa, out_a), (pb, out_b) = _swap_scenario(runner)
    for prompt, out in ((pa, out_a), (pb, out_b)):
        alone = _runner(qwen2, "bfloat16")
        got = alone.execute(StepPlan(step_id=0, params=[GREEDY], scheduled=[(0, len(prompt))], new_requests=[
            NewRequestData(0, prompt, [0, 1, 2, 3], 0, 0, len(prompt))])).token_ids
        for step in range(1, len(out)):
            got += alone.execute(StepPlan(step_id=step, params=[GREEDY], scheduled=[(0, 1)])).token_ids
        assert got == out


def _swap_scenario(runner: ModelRunner) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(prompt, greedy output) of A, swapped out mid-decode and back into other blocks after B
    overwrote its old ones, and of B."""
    pa, pb = _prompt(37, 1), _prompt(45, 2)
    out_a: list[int] = []
    step = 0

    def run(plan_kw: dict) -> list[int]:
        nonlocal step
        result = runner.execute(StepPlan(step_id=step, params=[GREEDY], **plan_kw))
        step += 1
        return result.token_ids

    out_a += run({"scheduled": [(0, 37)], "new_requests": [NewRequestData(0, pa, [0, 1, 2], 0, 0, 37)]})
    for _ in range(4):
        out_a += run({"scheduled": [(0, 1)]})
    # Preempt A: drop it from the worker and move its 3 blocks to CPU blocks 4, 0, 2.
    tokens_a = pa + out_a
    out_b = run({"scheduled": [(1, 45)], "finished_req_ids": [0], "swap_out": [(0, 4), (1, 0), (2, 2)],
                 "new_requests": [NewRequestData(1, pb, [2, 0, 1, 3], 0, 0, 45)]})
    for _ in range(3):
        out_b += run({"scheduled": [(1, 1)]})
    # Resume A in fresh blocks; its last sampled token is not computed yet.
    resumed = NewRequestData(0, tokens_a, [7, 5, 9], len(tokens_a) - 1, 0, 37)
    toks = run({"scheduled": [(1, 1), (0, 1)], "new_requests": [resumed], "swap_in": [(7, 4), (5, 0), (9, 2)]})
    out_b.append(toks[0])
    out_a.append(toks[1])
    for _ in range(3):
        toks = run({"scheduled": [(0, 1), (1, 1)]})
        out_a.append(toks[0])
        out_b.append(toks[1])
    return (pa, out_a), (pb, out_b)
