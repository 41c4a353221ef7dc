"""A KV cache of more than 2^31 elements: the kernels' element offsets into it (block id x
block size x heads x head size) are 64-bit. Under the CPU emulator, against the float64
reference, a sequence whose blocks lie past element 2^31 is written (reshape_and_cache) and
read (decode and prefill); a 32-bit product would wrap to a negative offset, which the
emulator's memory check reports, or to another block's data.

The cache is 4 GiB of address space (float16), allocated with torch.empty and never
filled, so only the pages of the few blocks the test touches are ever committed. K and V
are one tensor: the offsets, not the contents, are what is tested."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from noria.kernels import ops, reference
from noria.kernels.instances import (
    AttentionConfig,
    ModuleSpec,
    decode_module,
    prefill_module,
    reshape_module,
)
from noria.kernels.scenes import assert_matches

CFG = AttentionConfig("float16", 64, 16)
KV_HEADS, HEADS = 2, 4
BLOCK_ELEMS = CFG.block_size * KV_HEADS * CFG.head_dim  # 2048 = 2^11
# The first block whose first element lies past 2^31, and a few more.
FIRST_HIGH = (1 << 31) // BLOCK_ELEMS + 1
NUM_BLOCKS = FIRST_HIGH + 8


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [reshape_module(CFG.dtype), decode_module(CFG), prefill_module(CFG)]


@pytest.fixture(scope="module")
def big_cache() -> torch.Tensor:
    try:
        cache = torch.empty((NUM_BLOCKS, CFG.block_size, KV_HEADS, CFG.head_dim), dtype=torch.float16)
    except RuntimeError as e:  # a host that refuses 4 GiB of address space
        pytest.skip(f"cannot reserve the 4 GiB cache: {e}")
    assert cache.numel() > 1 << 31
    return cache


def test_offsets_past_two_to_the_31(emu: Any, big_cache: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(31)
    cache = big_cache
    length, new = 40, 9  # 3 blocks; the last 9 tokens are this step's queries
    blocks = [FIRST_HIGH + 5, FIRST_HIGH, FIRST_HIGH + 2]  # out of order, all past element 2^31
    table = torch.tensor([blocks], dtype=torch.int32)
    key = torch.randn(length, KV_HEADS, CFG.head_dim, generator=g).half()
    slots = torch.tensor([blocks[p // CFG.block_size] * CFG.block_size + p % CFG.block_size
                          for p in range(length)], dtype=torch.int64)
    assert int(slots[0]) * KV_HEADS * CFG.head_dim > 1 << 31
    backend = emu("forward")
    ops.reshape_and_cache(key, key, cache, cache, slots, backend=backend)
    k, _ = reference.gather_kv(cache, cache, table[0], length)
    assert torch.equal(k, key), "reshape_and_cache wrote somewhere else"

    scale = CFG.head_dim ** -0.5
    seq_lens = torch.tensor([length], dtype=torch.int32)
    query = torch.randn(1, HEADS, CFG.head_dim, generator=g).half()
    out = torch.zeros_like(query)
    ops.paged_attention_decode(out, query, cache, cache, table, seq_lens, scale, seq_lens_host=[length],
                               backend=backend)
    assert_matches(out, reference.paged_attention_decode(query, cache, cache, table, seq_lens, scale), CFG.dtype)

    queries = torch.randn(new, HEADS, CFG.head_dim, generator=g).half()
    out = torch.zeros_like(queries)
    starts = torch.tensor([0, new], dtype=torch.int32)
    ops.paged_attention_prefill(out, queries, cache, cache, table, seq_lens, starts, scale, max_query_len=new,
                                backend=backend)
    expected = reference.paged_attention_prefill(queries, cache, cache, table, seq_lens, starts, scale)
    assert_matches(out, expected, CFG.dtype)
