"""reshape_and_cache and copy_blocks under the CPU emulator against the torch reference.
Caches start NaN-filled: every slot a kernel must not touch has to stay NaN, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from noria.kernels import instances, ops, reference
from noria.kernels.instances import ModuleSpec
from noria.kernels.scenes import TORCH_DTYPES

DTYPES = list(TORCH_DTYPES)


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    if "dtype" in params:
        return [instances.reshape_module(params["dtype"])]
    return [instances.copy_module()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality that treats NaN as a value (the caches' untouched slots are NaN)."""
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("schedule", ["forward", "random:3"])
def test_reshape_and_cache(emu: Any, dtype: str, slot_dtype: torch.dtype, schedule: str) -> None:
    g = torch.Generator().manual_seed(11)
    num_blocks, bs, kvh, d, tokens = 9, 16, 2, 80, 37
    t = TORCH_DTYPES[dtype]
    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=t)
    v_cache = k_cache.clone()
    # Key and value are slices of one fused projection, as the worker produces them.
    qkv = torch.randn(tokens, (4 + 2 * kvh) * d, generator=g).to(t)
    key = qkv[:, 4 * d : (4 + kvh) * d].view(tokens, kvh, d)
    value = qkv[:, (4 + kvh) * d :].view(tokens, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    slots[::5] = -1  # padding tokens whose KV is not kept
    slot_mapping = slots.to(slot_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, backend=emu(schedule))
    assert same_bits(k_cache, expected_k) and same_bits(v_cache, expected_v)


def _caches(
    layers: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * layers)]


@pytest.mark.parametrize(
    "shape", [(12, 16, 2, 64), (12, 3, 1, 2)], ids=["16-byte-units", "4-byte-units"]
)
@pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])
def test_copy_blocks_swap(emu: Any, shape: tuple[int, ...], schedule: str) -> None:
    """Every layer's K and V in one launch, e.g. a swap-out to a CPU cache."""
    src = _caches(3, shape, torch.float16, 1)
    block_bytes = src[0][0].numel() * src[0].element_size()
    assert ops.copy_unit(block_bytes, [t.data_ptr() for t in src]) == (16 if shape[1] == 16 else 4)
    dst = [torch.full_like(t, float("nan")) for t in src]
    mapping = torch.tensor([[3, 0], [7, 5], [0, 11], [11, 2]])
    expected = [t.clone() for t in dst]
    reference.copy_blocks(src, expected, mapping)
    ops.copy_blocks(src, dst, mapping, backend=emu(schedule))
    assert all(same_bits(a, b) for a, b in zip(dst, expected, strict=True))


def test_copy_blocks_within_one_cache(emu: Any) -> None:
    """Source and destination are the same caches: a block is duplicated in place."""
    caches = _caches(2, (10, 32, 2, 96), torch.bfloat16, 2)
    mapping = torch.tensor([[1, 4], [2, 9]])
    expected = [t.clone() for t in caches]
    reference.copy_blocks(expected, expected, mapping)
    ops.copy_blocks(caches, caches, mapping, backend=emu("greedy"))
    assert all(same_bits(a, b) for a, b in zip(caches, expected, strict=True))
