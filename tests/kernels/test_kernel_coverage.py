"""The instances added for every head size of the supported families and every block size
the engine config accepts (head sizes 32 and 256, block sizes 8, 64 and 128), emulated on
small scenes against the float64 reference.

The NVRTC check compiles all of dtype x head size x block size (90 configurations); emulating
that cross product would cost minutes, so this runs a covering set: every new head size and
block size in two dtypes, every prefill key-tile shape (a whole block of 8 / 16 / 32 keys, a
32-key slice of a 64- or 128-token block, an 8-key slice for head size 256), decode single
pass and split-K, under two thread orders (the full matrix in kernel_matrix.py runs four)."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from kernel_matrix import cfg_id
from test_decode_attention import decode_case, run_decode
from test_prefill_attention import prefill_case, run_prefill

from noria.kernels import instances
from noria.kernels.instances import AttentionConfig, ModuleSpec, decode_module, prefill_module
from noria.kernels.scenes import assert_matches
from noria.protocol.config import BlockSize

COVERAGE_CONFIGS: list[AttentionConfig] = [
    AttentionConfig("float32", 32, 8),  # demo model's head size, smallest block
    AttentionConfig("bfloat16", 32, 128),
    AttentionConfig("float16", 256, 16),  # prefill: 8-key slices of a 16-token block
    AttentionConfig("float32", 256, 64),  # decode: two merge elements per thread
    AttentionConfig("float16", 128, 64),  # prefill: 32-key slices of a 64-token block
    AttentionConfig("bfloat16", 64, 8),
]
configs = pytest.mark.parametrize("cfg", COVERAGE_CONFIGS, ids=[cfg_id(c) for c in COVERAGE_CONFIGS])
schedules = pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    cfg = params.get("cfg")
    return [decode_module(cfg), prefill_module(cfg)] if cfg is not None else []


def test_block_sizes_match_the_engine_config() -> None:
    """Every block size `EngineConfig` accepts has kernels (no shape fails at the first step)."""
    assert set(typing.get_args(BlockSize)) == set(instances.BLOCK_SIZES)
    assert {32, 64, 80, 96, 128, 256} <= set(instances.HEAD_SIZES)


def test_coverage_set_covers_every_new_shape() -> None:
    assert {c.head_dim for c in COVERAGE_CONFIGS} >= {32, 256}
    assert {c.block_size for c in COVERAGE_CONFIGS} >= {8, 64, 128}
    assert len({c.dtype for c in COVERAGE_CONFIGS}) == 3


@configs
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@schedules
def test_decode_new_instances(emu: Any, cfg: AttentionConfig, split: bool, schedule: str) -> None:
    lens = (0, 1, cfg.block_size - 1, cfg.block_size + 1, 3 * cfg.block_size + 5, 700)
    scene, query, expected = decode_case(cfg, 4, 2, lens)
    out = run_decode(emu(schedule), scene, query, split=split, partition_size=cfg.block_size)
    assert_matches(out, expected, cfg.dtype)


@configs
@schedules
def test_prefill_new_instances(emu: Any, cfg: AttentionConfig, schedule: str) -> None:
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 4 * cfg.block_size + 3)
    assert_matches(run_prefill(emu(schedule), scene, query, qsl), expected, cfg.dtype)
