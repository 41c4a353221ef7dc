"""Which configurations the emulated tests run. The compile check covers every
dtype x head size x block size; emulation runs a covering subset: every dtype twice, every
head size and block size at least once, each under several thread orders (no single order
exposes every missing barrier)."""

from __future__ import annotations

import pytest

from noria.kernels.instances import AttentionConfig

EMU_CONFIGS: list[AttentionConfig] = [
    AttentionConfig("float32", 128, 16),
    AttentionConfig("float32", 80, 32),
    AttentionConfig("float16", 64, 16),
    AttentionConfig("float16", 96, 32),
    AttentionConfig("bfloat16", 128, 32),
    AttentionConfig("bfloat16", 80, 16),
]

# forward: round-robin; greedy(-reverse): the lowest (highest) warp runs ahead until it
# blocks; random: a seeded shuffle.
SCHEDULES: list[str] = ["forward", "greedy", "greedy-reverse", "random:7"]


def cfg_id(cfg: AttentionConfig) -> str:
    return f"{cfg.dtype}-d{cfg.head_dim}-b{cfg.block_size}"


def configs_param() -> pytest.MarkDecorator:
    return pytest.mark.parametrize("cfg", EMU_CONFIGS, ids=[cfg_id(c) for c in EMU_CONFIGS])


def schedules_param(schedules: list[str] | None = None) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("schedule", schedules or SCHEDULES)
