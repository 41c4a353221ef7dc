"""Sliding windows and attention logit soft-capping in every attention kernel the backend
launches (float32 CUDA-core decode with its split-K merge and prefill; the tensor-core GQA
decode with its merge and the tensor-core prefill), under the CPU emulator against the
float64 reference: windows of 1 token, across block and key-tile boundaries, and longer than
every context; chunked prefill over a cached prefix; soft-capping with scores large enough
that the cap changes the result; nothing outside a window is ever read (its cache slots and
block-table entries poisoned); and the host's split plans counting a window's keys, not the
context."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from kernel_matrix import SCHEDULES
from test_decode_attention_gqa import Recorder as EmuRecorder
from test_kernel_ops_api import Recorder, cache

from noria.kernels import instances, ops, reference
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.scenes import (
    TORCH_DTYPES,
    Scene,
    assert_matches,
    edge_lengths,
    first_seen_decode,
    first_seen_prefill,
    make_scene,
    poison_outside_windows,
)

SCALE = 0.37
CAP = 5.0
# Queries are scaled up with a soft-cap so that scale * q.k reaches well past the cap
# (standard deviation about 9 for head size 64): a kernel that skips the cap, or caps before
# the scale, is far off.
CAPPED_QUERY = 3.0

PREFILL_CONFIGS = [
    AttentionConfig("float32", 64, 16),  # CUDA-core prefill, 16-key tiles
    AttentionConfig("bfloat16", 64, 16),  # tensor cores, 32-key tiles over two blocks
    AttentionConfig("float16", 32, 8),  # tensor cores, 32-key tiles over four blocks
]
DECODE_CONFIGS = [
    AttentionConfig("float32", 64, 16),  # CUDA-core decode, split-K over blocks
    AttentionConfig("float16", 64, 16),  # tensor-core GQA decode
    AttentionConfig("bfloat16", 32, 8),  # its key tiles span four blocks
]
# (window, soft-cap): one token; across block and key-tile edges; longer than every context;
# the cap alone and with a window.
CASES = [(1, None), (13, None), (40, None), (4096, None), (None, CAP), (13, CAP)]


def cfg_id(c: AttentionConfig) -> str:
    return f"{c.dtype}-d{c.head_dim}-b{c.block_size}"


def case_id(c: tuple[int | None, float | None]) -> str:
    window, cap = c
    return "-".join(([f"w{window}"] if window else []) + ([f"cap{cap:g}"] if cap else []))


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    cfgs = [params["cfg"]] if "cfg" in params else [*PREFILL_CONFIGS, *DECODE_CONFIGS]
    return [s for c in cfgs for s in (instances.prefill_module(c), instances.decode_module(c))]


def window_batch(bs: int) -> list[tuple[int, int]]:
    """(context after the step, query tokens) per sequence."""
    return [
        (70, 70),  # a whole prompt over several query tiles: windows start inside key tiles
        (2 * bs + 5, 9),  # chunked prefill: a chunk after 2 bs - 4 cached tokens
        (6, 6),  # a prompt shorter than most windows
        (100, 20),  # a chunk after a long prefix: whole key tiles before every window
        (50, 1),  # a decode row riding along
        (0, 0),  # an empty sequence
        (bs, 0),  # nothing scheduled this step
    ]


def _queries(cfg: AttentionConfig, tokens: int, heads: tuple[int, int], seed: int, capped: bool) -> torch.Tensor:
    """Queries as the Q slice of a fused QKV row (token stride wider than the heads)."""
    num_heads, num_kv_heads = heads
    d = cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * d, generator=g)
    if capped:
        qkv *= CAPPED_QUERY
    return qkv.to(TORCH_DTYPES[cfg.dtype])[:, : num_heads * d].view(tokens, num_heads, d)


@functools.cache
def prefill_case(
    cfg: AttentionConfig, batch: tuple[tuple[int, int], ...], heads: tuple[int, int],
    window: int | None, cap: float | None,
) -> tuple[Scene, torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = zlib.crc32(repr((cfg, batch, heads)).encode())
    scene = make_scene(cfg, [c for c, _ in batch], heads[1], seed)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
    query = _queries(cfg, int(qsl[-1]), heads, seed + 1, cap is not None)
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
        window=window, soft_cap=cap,
    )
    return scene, query, qsl, expected


@functools.cache
def decode_case(
    cfg: AttentionConfig, lens: tuple[int, ...], heads: tuple[int, int], window: int | None,
    cap: float | None,
) -> tuple[Scene, torch.Tensor, torch.Tensor]:
    seed = zlib.crc32(repr((cfg, lens, heads)).encode())
    scene = make_scene(cfg, list(lens), heads[1], seed)
    query = _queries(cfg, len(lens), heads, seed + 1, cap is not None)
    expected = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE,
        window=window, soft_cap=cap,
    )
    return scene, query, expected


def run_prefill(be: Any, scene: Scene, query: torch.Tensor, qsl: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_prefill(
        out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
        backend=be, **kw,
    )
    return out


def run_decode(be: Any, scene: Scene, query: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_decode(
        out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE,
        backend=be, **kw,
    )
    return out


def decode_partition(cfg: AttentionConfig) -> int:
    """Split-K partitions of one block (float32) or three (16-bit: partitions that end inside
    a key tile), so a window spans several."""
    return cfg.block_size if cfg.dtype == "float32" else 3 * cfg.block_size


@pytest.mark.parametrize("cfg", PREFILL_CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_window_prefill(emu: Any, cfg: AttentionConfig, case: tuple[int | None, float | None], schedule: str) -> None:
    """The ragged batch with GQA 4 / 2 (two query heads per KV head: a tensor-core tile holds
    32 tokens)."""
    window, cap = case
    batch = tuple(window_batch(cfg.block_size))
    scene, query, qsl, expected = prefill_case(cfg, batch, (4, 2), window, cap)
    out = run_prefill(emu(schedule), scene, query, qsl, window=window, soft_cap=cap)
    assert_matches(out, expected, cfg.dtype)


@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_window_decode(
    emu: Any, cfg: AttentionConfig, split: bool, case: tuple[int | None, float | None], schedule: str
) -> None:
    """GQA 8 / 2, contexts 0, 1, bs - 1, bs, bs + 1, 3 bs + 5 and 300; split: partitions of
    one or three blocks counted from the window's first key (its block, in float32)."""
    window, cap = case
    lens = tuple(edge_lengths(cfg.block_size, 300))
    scene, query, expected = decode_case(cfg, lens, (8, 2), window, cap)
    out = run_decode(emu(schedule), scene, query, split=split, partition_size=decode_partition(cfg),
                     window=window, soft_cap=cap)
    assert_matches(out, expected, cfg.dtype)


def test_soft_cap_changes_the_reference() -> None:
    """The capped cases are not a no-op: the cap moves the float64 result far past every
    tolerance (and so does the window)."""
    cfg = DECODE_CONFIGS[1]
    lens = tuple(edge_lengths(cfg.block_size, 300))
    capped = decode_case(cfg, lens, (8, 2), None, CAP)
    scene, query, _ = capped
    plain = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE
    )
    assert (capped[2] - plain).abs().max() > 0.3
    windowed = decode_case(cfg, lens, (8, 2), 13, None)[2]
    assert (windowed - decode_case(cfg, lens, (8, 2), None, None)[2]).abs().max() > 0.3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_window_mixed_step(emu: Any, dtype: str) -> None:
    """ops.paged_attention with the step plan: decode rows on the GQA decode kernel, the rest on
    the tensor-core prefill kernel, both windowed and capped."""
    cfg = AttentionConfig(dtype, 64, 16)
    batch = ((40, 1), (70, 33), (17, 1), (100, 9), (70, 1))
    scene, query, qsl, expected = prefill_case(cfg, batch, (8, 2), 21, CAP)
    plan = ops.plan_step([q for _, q in batch], [c for c, _ in batch], torch.device("cpu"))
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention(
        out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
        max_query_len=33, max_seq_len=100, plan=plan, window=21, soft_cap=CAP, backend=emu("greedy"),
    )
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("cfg", [PREFILL_CONFIGS[0], PREFILL_CONFIGS[1]], ids=cfg_id)
def test_nothing_outside_the_window_is_read(emu: Any, cfg: AttentionConfig) -> None:
    """Prefill and decode (single pass and split) with every key that no query of a sequence
    sees poisoned (NaN, table entries to the poison block; the two longest sequences share
    their first blocks): the outputs match the clean scene's reference, so no kernel loads a
    key or a block-table entry before its window."""
    window, bs = 13, cfg.block_size
    batch = tuple(window_batch(bs))
    scene, query, qsl, expected = prefill_case(cfg, batch, (4, 2), window, None)
    first_seen = first_seen_prefill([c for c, _ in batch], [q for _, q in batch], window)
    assert sum(lo // bs for lo in first_seen) >= 8  # whole blocks are poisoned, not only slots
    poisoned = poison_outside_windows(scene, first_seen)
    be = emu("forward")
    assert_matches(run_prefill(be, poisoned, query, qsl, window=window), expected, cfg.dtype)

    lens = (0, 1, bs + 1, 3 * bs + 5, 300)
    scene, query, expected = decode_case(cfg, lens, (8, 2), window, None)
    poisoned = poison_outside_windows(scene, first_seen_decode(list(lens), window))
    for split in (False, True):
        out = run_decode(be, poisoned, query, split=split, partition_size=decode_partition(cfg), window=window)
        assert_matches(out, expected, cfg.dtype)


def test_decode_split_plans_count_the_window() -> None:
    """A sliding-window sequence's work is its window: float32's split-K grid covers the window
    (from its first key's block), the tensor-core kernel's balanced plan counts min(context,
    window) per sequence, and the merge kernels get what places the partitions."""
    rec = Recorder()
    k, v = cache(blocks=260, dtype=torch.float32)
    q = torch.zeros(2, 4, 64, dtype=torch.float32)
    tables = torch.zeros(2, 260, dtype=torch.int32)
    seq_lens = torch.tensor([4000, 7], dtype=torch.int32)
    args = (torch.empty_like(q), q, k, v, tables, seq_lens, 0.1)
    ops.paged_attention_decode(*args, max_seq_len=4000, backend=rec)
    assert rec.launches[0]["grid"] == (4, 2, 8)  # no window: 8 partitions of 512
    rec.launches.clear()
    ops.paged_attention_decode(*args, max_seq_len=4000, window=600, backend=rec)
    assert [launch["grid"] for launch in rec.launches] == [(4, 2, 1)]  # 600 keys: not worth a split
    assert rec.launches[0]["args"][-2:] == (np.int32(600), np.float32(0.0))
    rec.launches.clear()
    ops.paged_attention_decode(*args, max_seq_len=4000, split=True, partition_size=32, window=40,
                               soft_cap=30.0, backend=rec)
    decode, merge = rec.launches
    assert decode["grid"] == (4, 2, 2)  # 40 keys from their block's start: at most 55 tokens
    assert decode["args"][-2:] == (np.int32(40), np.float32(30.0))
    assert merge["args"][-2:] == (np.int32(16), np.int32(40))  # block size, window

    rec.launches.clear()
    k16, v16 = cache(blocks=260, dtype=torch.float16)
    q16 = q.to(torch.float16)
    args16 = (torch.empty_like(q16), q16, k16, v16, tables, seq_lens, 0.1)
    ops.paged_attention_decode(*args16, seq_lens_host=[4000, 7], backend=rec)
    assert rec.launches[0]["grid"][0] > 2  # the long context is split
    rec.launches.clear()
    ops.paged_attention_decode(*args16, seq_lens_host=[4000, 7], window=256, backend=rec)
    assert [launch["grid"] for launch in rec.launches] == [(2, 2)]  # 256 keys each at most: whole
    rec.launches.clear()
    ops.paged_attention_decode(*args16, split=True, partition_size=32, window=40, backend=rec)
    assert rec.launches[0]["grid"] == (2 + 1, 2)  # ceil(40 / 32) + ceil(7 / 32) work items
    assert rec.launches[0]["args"][-4] == np.int32(40)  # window; then soft-cap, k_scale, v_scale


def test_balanced_plan_with_window_runs(emu: Any) -> None:
    """The default plan (split=None) on a 3001-token context with a 600-token window among
    short ones: the window, not the context, is split, in one launch plus the merge."""
    cfg = DECODE_CONFIGS[1]
    lens = (3001, 7, 250)
    scene, query, expected = decode_case(cfg, lens, (8, 2), 600, None)
    be = EmuRecorder(emu("forward"))
    plan = ops.plan_decode_split(ops.windowed_lengths(lens, 600), 2, be.sm_count, cfg.block_size)
    assert plan.parts[0] > 1 and plan.parts[1:] == (1, 1)
    assert_matches(run_decode(be, scene, query, window=600), expected, cfg.dtype)
    assert be.launches[0] == ("paged_attention_decode_gqa", (plan.num_items, 2))


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_bad_window_is_refused(window: Any) -> None:
    k, v = cache()
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    args = (torch.empty_like(q), q, k, v, torch.zeros(1, 8, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="window"):
        ops.paged_attention_decode(*args, window=window, backend=Recorder())


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_soft_cap_is_refused(cap: float) -> None:
    k, v = cache()
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    args = (torch.empty_like(q), q, k, v, torch.zeros(1, 8, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="soft_cap"):
        ops.paged_attention_prefill(*args, qsl, 0.1, soft_cap=cap, backend=Recorder())
