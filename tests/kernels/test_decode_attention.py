"""Decode paged attention, single pass and split-K, run by the CPU emulator against the
float64 torch reference."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import pytest
import torch
from kernel_matrix import EMU_CONFIGS, cfg_id, configs_param, schedules_param

from noria.kernels import ops, reference
from noria.kernels.instances import AttentionConfig, ModuleSpec, decode_module, uses_gqa_decode
from noria.kernels.scenes import TORCH_DTYPES, Scene, assert_matches, edge_lengths, make_scene

SCALE = 0.37  # deliberately not 1/sqrt(head_dim): a kernel that drops or redoes it fails
LONG = 2100  # a few thousand tokens, not a multiple of 32: >128 one-block partitions


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [decode_module(params["cfg"])] if "cfg" in params else []


@functools.cache
def decode_case(
    cfg: AttentionConfig, num_heads: int, num_kv_heads: int, lens: tuple[int, ...]
) -> tuple[Scene, torch.Tensor, torch.Tensor]:
    seed = zlib.crc32(repr((cfg, num_heads, num_kv_heads, lens)).encode())
    scene = make_scene(cfg, list(lens), num_kv_heads, seed)
    g = torch.Generator().manual_seed(seed + 1)
    d = cfg.head_dim
    # The query is the Q part of a fused QKV row, so its token stride is not heads * d.
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * d, generator=g)
    query = qkv.to(TORCH_DTYPES[cfg.dtype])[:, : num_heads * d].view(len(lens), num_heads, d)
    expected = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE
    )
    return scene, query, expected


def run_decode(backend: Any, scene: Scene, query: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_decode(
        out,
        query,
        scene.k_cache,
        scene.v_cache,
        scene.block_tables,
        scene.seq_lens,
        SCALE,
        backend=backend,
        **kw,
    )
    return out


@configs_param()
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@schedules_param()
def test_decode_matches_reference(
    emu: Any, cfg: AttentionConfig, split: bool, schedule: str
) -> None:
    """GQA (8 query heads over 2 KV heads), contexts 0, 1, bs-1, bs, bs+1, ... and ~2000.
    Split-K with one block per partition: the long context has 66 or 132 of them, so every
    warp of the merge kernel has partitions and its per-thread loop wraps."""
    scene, query, expected = decode_case(cfg, 8, 2, tuple(edge_lengths(cfg.block_size, LONG)))
    out = run_decode(emu(schedule), scene, query, split=split, partition_size=cfg.block_size)
    assert_matches(out, expected, cfg.dtype)


@pytest.mark.parametrize("cfg", [EMU_CONFIGS[0], EMU_CONFIGS[3]], ids=cfg_id)
@pytest.mark.parametrize("heads", [(4, 1), (4, 4)], ids=["mqa", "mha"])
@schedules_param(["forward", "greedy-reverse"])
def test_decode_head_layouts(
    emu: Any, cfg: AttentionConfig, heads: tuple[int, int], schedule: str
) -> None:
    scene, query, expected = decode_case(cfg, *heads, tuple(edge_lengths(cfg.block_size, 300)))
    out = run_decode(emu(schedule), scene, query, split=False)
    assert_matches(out, expected, cfg.dtype)


@pytest.mark.parametrize("cfg", [EMU_CONFIGS[0], EMU_CONFIGS[4]], ids=cfg_id)
@schedules_param(["forward", "greedy"])
def test_decode_long_context_takes_split_path(
    emu: Any, cfg: AttentionConfig, schedule: str
) -> None:
    """With the default plan and few sequences, a 3001-token context is split (float32:
    choose_num_partitions; 16-bit: the tensor-core kernel's balanced plan)."""
    lens = (3001, 700, 7)
    backend = emu(schedule)
    if uses_gqa_decode(cfg):
        assert ops.plan_decode_split(lens, 2, backend.sm_count, cfg.block_size).max_parts > 1
    else:
        assert ops.choose_num_partitions(max(lens), len(lens), 4, backend.sm_count) > 1
    scene, query, expected = decode_case(cfg, 4, 2, lens)
    assert_matches(run_decode(backend, scene, query), expected, cfg.dtype)


def test_choose_num_partitions() -> None:
    sms = 132
    assert ops.choose_num_partitions(512, 1, 8, sms) == 1  # one partition's worth
    assert ops.choose_num_partitions(1000, 1, 8, sms) == 1  # short: merging costs more
    assert ops.choose_num_partitions(4096, 1, 8, sms) == 8  # few CTAs: split
    assert ops.choose_num_partitions(4096, 256, 32, sms) == 1  # GPU already full
    assert ops.choose_num_partitions(4097, 2, 8, sms, partition_size=1024) == 5
