"""The tensor-core prefill kernel (kernels/csrc/prefill_attention_tc.cu, float16 / bfloat16)
under the CPU emulator against the float64 reference: the ragged batch of the CUDA-core
prefill tests (whole prompts, chunked prefill over a cached prefix, decode rows, empty
sequences), block and query-tile edges, GQA groups of 1, 3, 4 and 8 packed into the tile's
rows, the causal diagonal, the flat work list, and a mixed step whose decode rows go to the
decode kernel and the rest to this one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kernel_matrix import SCHEDULES
from test_prefill_attention import SCALE, prefill_case

from noria.kernels import instances, ops, reference
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.options import SOURCE_DIR
from noria.kernels.scenes import Scene, assert_matches, make_scene

SOURCE = "prefill_attention_tc.cu"
CONFIGS = [
    AttentionConfig("bfloat16", 64, 16),
    AttentionConfig("float16", 128, 32),
    AttentionConfig("bfloat16", 80, 8),  # key tiles span four blocks
    AttentionConfig("float16", 256, 16),  # 16-key tiles, no row padding
    AttentionConfig("float16", 32, 128),  # a key tile is a slice of a block
]


def cfg_id(c: AttentionConfig) -> str:
    return f"{c.dtype}-d{c.head_dim}-b{c.block_size}"


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    cfg = params.get("cfg", CONFIGS[0])
    return [instances.prefill_module(cfg), instances.decode_module(cfg)]


def run_tc(backend: Any, scene: Scene, query: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """ops.paged_attention_prefill: 16-bit caches take the tensor-core kernel."""
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_prefill(
        out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
        backend=backend,
    )
    return out


def case(
    cfg: AttentionConfig, batch: list[tuple[int, int]], heads: tuple[int, int], seed: int
) -> tuple[Scene, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scene for (context after the step, query tokens) per sequence, its query (a slice of a
    wider QKV row, as the model passes it) and the float64 reference."""
    num_heads, num_kv_heads = heads
    scene = make_scene(cfg, [c for c, _ in batch], num_kv_heads, seed=seed)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
    g = torch.Generator().manual_seed(seed + 1)
    d = cfg.head_dim
    qkv = torch.randn(int(qsl[-1]), (num_heads + 2 * num_kv_heads) * d, generator=g).to(scene.dtype)
    query = qkv[:, : num_heads * d].view(-1, num_heads, d)
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE
    )
    return scene, query, qsl, expected


def test_work_items_cover_every_packed_tile() -> None:
    # group 4: 16 tokens per 64-row tile; 0 and 1 token sequences; 17 tokens = 68 rows, 2 tiles
    items = ops.prefill_work_items([0, 1, 16, 17, 0, 40], 4)
    assert items.dtype == np.int32
    assert items.tolist() == [[1, 0], [2, 0], [3, 0], [3, 1], [5, 0], [5, 1], [5, 2]]
    assert ops.prefill_work_items([], 1).shape == (0, 2)
    assert ops.prefill_work_items([3, 0], 8).tolist() == [[0, 0]]


def test_plan_splits_decode_rows() -> None:
    cpu = torch.device("cpu")
    together = ops.plan_step([5, 1, 1, 0, 7], [9, 4, 6, 2, 7], cpu)
    assert together.decode_seqs == [1, 2]
    assert together.decode_seq_index == slice(1, 3) and together.decode_token_index == slice(5, 7)
    # The decode sequences get no prefill work item; without skip_decode they do.
    assert 1 not in together.work(2, True)[:, 0].tolist() and 2 not in together.work(2, True)[:, 0].tolist()
    assert {1, 2} <= set(together.work(2, False)[:, 0].tolist())
    apart = ops.plan_step([1, 5, 1], [3, 5, 8], cpu)
    assert apart.decode_seq_index.tolist() == [0, 2]  # type: ignore[union-attr]
    assert apart.decode_token_index.tolist() == [0, 6]  # type: ignore[union-attr]
    assert ops.plan_step([1, 1], [3, 4], cpu).decode_seq_index is None  # pure decode: no split


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tc_prefill_matches_reference(emu: Any, cfg: AttentionConfig, schedule: str) -> None:
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 150)
    assert_matches(run_tc(emu(schedule), scene, query, qsl), expected, cfg.dtype)


@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (4, 1), (8, 1)], ids=["g1", "g3", "g4", "g8"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tc_prefill_gqa_groups(emu: Any, heads: tuple[int, int], schedule: str) -> None:
    """The query heads of a KV head share a tile's rows: with 3 heads a token straddles two
    tiles, with 8 a tile holds 8 tokens; a 9-token chunk over a 30-token cached prefix."""
    cfg = CONFIGS[0]
    batch = [(22, 22), (39, 9), (16, 16), (1, 1), (0, 0)]
    scene, query, qsl, expected = case(cfg, batch, heads, seed=21)
    assert_matches(run_tc(emu(schedule), scene, query, qsl), expected, cfg.dtype)


def test_tc_prefill_long_prompts_span_query_tiles(emu: Any) -> None:
    """Prompts of 150 and 64 tokens and a 30-token chunk after 170 cached ones under GQA 2:
    several 64-row tiles per sequence (the last partly filled, with warps that have no rows),
    query tiles that end exactly on a key tile, and many causal tiles a warp skips."""
    cfg = CONFIGS[0]
    scene, query, qsl, expected = case(cfg, [(150, 150), (64, 64), (200, 30)], (4, 2), seed=11)
    assert_matches(run_tc(emu("greedy-reverse"), scene, query, qsl), expected, cfg.dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("apart", [False, True], ids=["decodes-together", "decodes-apart"])
def test_mixed_step_splits_decode_and_prefill(emu: Any, dtype: str, apart: bool) -> None:
    """ops.paged_attention with a plan: the prefill kernel leaves the decode rows alone (they
    stay NaN when it runs by itself), the decode kernel fills them, and together they match
    the reference. Decode sequences side by side are passed as views, apart as gathered rows."""
    cfg = AttentionConfig(dtype, 64, 16)
    if apart:
        batch = [(40, 1), (33, 33), (17, 1), (50, 9), (70, 1)]
    else:
        batch = [(33, 33), (40, 1), (17, 1), (70, 1), (50, 9)]
    scene, query, qsl, expected = case(cfg, batch, (8, 2), seed=31)
    plan = ops.plan_step([q for _, q in batch], [c for c, _ in batch], torch.device("cpu"))
    be = emu("forward")
    args = (query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE)
    decode_tokens = [int(qsl[s]) for s in plan.decode_seqs]

    alone = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_prefill(alone, *args, plan=plan, skip_decode=True, backend=be)
    assert torch.isnan(alone[decode_tokens]).all()
    others = [t for t in range(query.shape[0]) if t not in decode_tokens]
    assert_matches(alone[others], expected[others], dtype)

    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention(out, *args, max_query_len=33, max_seq_len=70, plan=plan, backend=be)
    assert_matches(out, expected, dtype)


def test_tc_prefill_causal_mutant_is_caught(tmp_path: Path) -> None:
    from noria.kernels.backends import EmuBackend
    from noria.kernels.emu import EmuConfig

    src = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, src)
    path = src / SOURCE
    old = "if (kpos > qpos[i >> 1]) v = neg_inf();"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, "if (kpos >= qpos[i >> 1]) v = neg_inf();"))
    cfg = CONFIGS[0]
    scene, query, qsl, expected = prefill_case(cfg, 4, 2, 70)
    be = EmuBackend(src, EmuConfig(workers=2, memcheck=True))
    with pytest.raises(AssertionError):
        assert_matches(run_tc(be, scene, query, qsl), expected, cfg.dtype)


def test_mixed_step_launches_only_rows_each_kernel_computes() -> None:
    """A 2048-token chunk beside 255 decodes (the case a max_q x heads x seqs grid turned into
    about a million mostly idle CTAs per layer): the prefill launch has one CTA per
    64 packed rows of the chunk and KV head, the decode launch covers the 255 decode rows."""
    from test_kernel_ops_api import Recorder

    num_heads, num_kv_heads, d, bs = 32, 8, 128, 16
    q_lens = [1] * 100 + [2048] + [1] * 155
    ctx = [300] * 100 + [2048] + [300] * 155
    plan = ops.plan_step(q_lens, ctx, torch.device("cpu"))
    tokens = sum(q_lens)
    q = torch.zeros(tokens, num_heads, d, dtype=torch.bfloat16)
    cache = torch.zeros(4, bs, num_kv_heads, d, dtype=torch.bfloat16)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    rec = Recorder()
    ops.paged_attention(
        torch.empty_like(q), q, cache, cache, torch.zeros(len(q_lens), 130, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32), qsl, 0.1, max_query_len=2048, max_seq_len=2048,
        plan=plan, backend=rec,
    )
    prefill, decode = rec.launches[0], rec.launches[1]
    assert prefill["name"].startswith("paged_attention_prefill_tc")
    assert prefill["grid"] == (2048 * (num_heads // num_kv_heads) // 64, num_kv_heads)
    assert decode["name"].startswith("paged_attention_decode")
    assert np.prod(decode["grid"]) < 2 * 255 * num_heads
