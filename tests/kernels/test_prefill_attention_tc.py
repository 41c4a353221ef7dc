"""The tensor-core prefill kernel (kernels/csrc/prefill_attention_tc.cu, not used by ops yet)
under the CPU emulator against the float64 reference: the ragged batch of the CUDA-core
prefill tests (whole prompts, chunked prefill, long cached prefixes, decode rows, empty
sequences), GQA / MQA / MHA, and a causal-mask mutant that the test must catch."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_prefill_attention import SCALE, prefill_case

from noria.kernels import nvrtc_check, reference
from noria.kernels.backends import EmuBackend
from noria.kernels.emu import EmuConfig
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.options import ARCHS, PTXAS_VERBOSE, SOURCE_DIR, compile_options, read_source
from noria.kernels.scenes import Scene, assert_matches, make_scene

SOURCE = "prefill_attention_tc.cu"
TILE_Q = 64
CONFIGS = [
    AttentionConfig("bfloat16", 64, 16),
    AttentionConfig("float16", 128, 32),
    AttentionConfig("bfloat16", 80, 8),  # key tiles span four blocks
    AttentionConfig("float16", 256, 16),  # 16-key tiles, no row padding
    AttentionConfig("float16", 32, 128),  # a key tile is a slice of a block
]


def _name(cfg: AttentionConfig) -> str:
    return f"paged_attention_prefill_tc<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


@functools.cache
def _backend(source_dir: Path, schedule: str) -> EmuBackend:
    return EmuBackend(source_dir, EmuConfig(schedule=schedule, workers=2, memcheck=True))


def run_tc(
    cfg: AttentionConfig,
    scene: Scene,
    query: torch.Tensor,
    qsl: torch.Tensor,
    schedule: str = "forward",
    source_dir: Path = SOURCE_DIR,
) -> torch.Tensor:
    be = _backend(source_dir, schedule)
    kern = be.kernel(ModuleSpec(SOURCE, (_name(cfg),)), _name(cfg))
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    num_seqs = scene.seq_lens.shape[0]
    max_q = int((qsl[1:] - qsl[:-1]).max())
    args: tuple[Any, ...] = (
        be.ptr(out),
        be.ptr(query),
        be.ptr(scene.k_cache),
        be.ptr(scene.v_cache),
        be.ptr(scene.block_tables),
        be.ptr(scene.seq_lens),
        be.ptr(qsl),
        np.float32(SCALE),
        np.int32(scene.k_cache.shape[2]),
        np.int32(query.stride(0)),
        np.int32(scene.block_tables.stride(0)),
    )
    kern((-(-max_q // TILE_Q), query.shape[1], num_seqs), (128,), args)
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.dtype}-d{c.head_dim}-b{c.block_size}")
@pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])
def test_tc_prefill_matches_reference(cfg: AttentionConfig, schedule: str) -> None:
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 150)
    assert_matches(run_tc(cfg, scene, query, qsl, schedule), expected, cfg.dtype)


@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["mqa", "mha"])
def test_tc_prefill_head_layouts(heads: tuple[int, int]) -> None:
    cfg = CONFIGS[0]
    scene, query, qsl, expected = prefill_case(cfg, *heads, 70)
    assert_matches(run_tc(cfg, scene, query, qsl), expected, cfg.dtype)


def test_tc_prefill_long_prompts_span_query_tiles() -> None:
    """Prompts of 150 and 64 tokens and a 30-token chunk after 170 cached ones: three query
    tiles of 64 (the last partly filled, with warps that have no rows), a tile exactly full."""
    cfg = CONFIGS[0]
    lens, q_lens = [150, 64, 200], [150, 64, 30]
    scene = make_scene(cfg, lens, 2, seed=11)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(int(qsl[-1]), 8 * cfg.head_dim, generator=g).to(scene.dtype)
    query = qkv[:, : 4 * cfg.head_dim].view(-1, 4, cfg.head_dim)
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE
    )
    assert_matches(run_tc(cfg, scene, query, qsl, "greedy-reverse"), expected, cfg.dtype)


def test_tc_prefill_causal_mutant_is_caught(tmp_path: Path) -> None:
    src = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, src)
    path = src / SOURCE
    old = "if (kpos > qpos + 8 * (i >> 1)) v = neg_inf();"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, "if (kpos >= qpos + 8 * (i >> 1)) v = neg_inf();"))
    cfg = CONFIGS[0]
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 70)
    with pytest.raises(AssertionError):
        assert_matches(run_tc(cfg, scene, query, qsl, source_dir=src), expected, cfg.dtype)


@pytest.mark.parametrize("arch", ARCHS)
def test_tc_prefill_compiles_with_nvrtc_without_spills(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every head size, both 16-bit dtypes, through RawModule's NVRTC call (ptxas -v)."""
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    names = [
        _name(AttentionConfig(dtype, d, 16))
        for dtype in ("float16", "bfloat16")
        for d in (32, 64, 80, 96, 128, 256)
    ]
    with nvrtc_check.offline_nvrtc(arch) as calls:
        log = nvrtc_check.rawmodule_compile(
            read_source(SOURCE), compile_options() + PTXAS_VERBOSE, names
        )
    [call] = calls
    usage = nvrtc_check.parse_ptxas(log, arch, SOURCE, call["mapping"] or {})
    assert sorted(u.name for u in usage) == sorted(names)
    spilled = [u for u in usage if u.spill_stores or u.spill_loads or u.stack_bytes]
    assert not spilled, spilled
    assert max(u.shared_bytes for u in usage) <= 48 * 1024
