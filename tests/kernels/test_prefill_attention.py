"""Ragged prefill attention over the paged cache, run by the CPU emulator against the
float64 torch reference: whole prompts, chunked prefill, prefix-cache hits, decodes riding
along and sequences with nothing scheduled, all in one flattened batch."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import pytest
import torch
from kernel_matrix import EMU_CONFIGS, cfg_id, configs_param, schedules_param

from noria.kernels import ops, reference
from noria.kernels.instances import AttentionConfig, ModuleSpec, prefill_module
from noria.kernels.scenes import TORCH_DTYPES, Scene, assert_matches, make_scene

SCALE = 0.37


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [prefill_module(params["cfg"])] if "cfg" in params else []


def ragged_batch(block_size: int, long: int) -> list[tuple[int, int]]:
    """(context length after the step, query tokens this step) per sequence."""
    bs = block_size
    return [
        (1, 1),  # a one-token prompt
        (bs - 1, bs - 1),  # whole prompt, one short of a block
        (bs + 1, bs + 1),  # whole prompt crossing a block and a query tile
        (2 * bs + 5, 7),  # chunked prefill: a chunk after 2 * bs - 2 cached tokens
        (0, 0),  # an empty sequence
        (long, 20),  # long cached prefix (prefix-cache hit or a late chunk)
        (3 * bs, 1),  # a decode in the same batch
        (bs, 0),  # scheduled nothing this step
    ]


@functools.cache
def prefill_case(
    cfg: AttentionConfig, num_heads: int, num_kv_heads: int, long: int
) -> tuple[Scene, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = ragged_batch(cfg.block_size, long)
    seed = zlib.crc32(repr((cfg, num_heads, num_kv_heads, long)).encode())
    scene = make_scene(cfg, [ctx for ctx, _ in batch], num_kv_heads, seed)
    q_lens = torch.tensor([q for _, q in batch])
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    g = torch.Generator().manual_seed(seed + 1)
    d, tokens = cfg.head_dim, int(qsl[-1])
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * d, generator=g)
    query = qkv.to(TORCH_DTYPES[cfg.dtype])[:, : num_heads * d].view(tokens, num_heads, d)
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE
    )
    return scene, query, qsl, expected


def run_prefill(backend: Any, scene: Scene, query: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_prefill(
        out,
        query,
        scene.k_cache,
        scene.v_cache,
        scene.block_tables,
        scene.seq_lens,
        qsl,
        SCALE,
        backend=backend,
    )
    return out


@configs_param()
@schedules_param()
def test_prefill_matches_reference(emu: Any, cfg: AttentionConfig, schedule: str) -> None:
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 1500)
    assert_matches(run_prefill(emu(schedule), scene, query, qsl), expected, cfg.dtype)


@pytest.mark.parametrize("cfg", [EMU_CONFIGS[1], EMU_CONFIGS[2]], ids=cfg_id)
@pytest.mark.parametrize("heads", [(4, 1), (4, 4)], ids=["mqa", "mha"])
@schedules_param(["forward", "greedy-reverse"])
def test_prefill_head_layouts(
    emu: Any, cfg: AttentionConfig, heads: tuple[int, int], schedule: str
) -> None:
    scene, query, qsl, expected = prefill_case(cfg, *heads, 100)
    assert_matches(run_prefill(emu(schedule), scene, query, qsl), expected, cfg.dtype)
