"""The tensor-core GQA decode kernel (kernels/csrc/decode_attention_gqa.cu, float16 and
bfloat16) under the CPU emulator against the float64 reference: every head size and block
size, ragged contexts around block and key-tile edges, groups of 1, 4, 8 and 20 query heads
per KV head (20: two CTAs per KV head, the second with 4 real rows), split and unsplit
sequences in one launch, and the work-balanced split plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kernel_matrix import cfg_id, schedules_param
from test_decode_attention import decode_case, run_decode
from test_kernel_ops_api import Recorder as ApiRecorder
from test_kernel_ops_api import cache as api_cache

from noria.kernels import decode_launch, ops
from noria.kernels.instances import AttentionConfig, ModuleSpec, decode_module
from noria.kernels.scenes import assert_matches, edge_lengths

# Every head size and every block size at least once, both dtypes.
CONFIGS = [
    AttentionConfig("bfloat16", 32, 8),  # 32-key tiles span four blocks
    AttentionConfig("float16", 64, 128),  # a tile is a slice of a block; 4 stages
    AttentionConfig("bfloat16", 80, 32),  # column tiles 10: warps own 3, 3, 2, 2
    AttentionConfig("float16", 96, 16),  # 3 stages
    AttentionConfig("bfloat16", 128, 64),  # 2 stages
    AttentionConfig("float16", 256, 16),  # 16-key tiles, two warps per key tile
]
CONTEXT = 300  # the longest context: ~10 key tiles, several partitions


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    cfgs = [params["cfg"]] if "cfg" in params else [CONFIGS[0], CONFIGS[4], AttentionConfig("float16", 64, 16)]
    return [decode_module(c) for c in cfgs]


def lengths(cfg: AttentionConfig) -> tuple[int, ...]:
    return tuple(edge_lengths(cfg.block_size, CONTEXT))


class Recorder:
    """An emulator backend that records every launch's kernel name and grid."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.launches: list[tuple[str, tuple[int, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def kernel(self, spec: ModuleSpec, name: str) -> Any:
        kern = self.backend.kernel(spec, name)

        def launch(grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
            self.launches.append((name.partition("<")[0], tuple(grid)))
            kern(grid, block, args, shared_mem=shared_mem)

        return launch


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@schedules_param()
def test_gqa_decode_matches_reference(emu: Any, cfg: AttentionConfig, split: bool, schedule: str) -> None:
    """8 query heads over 2 KV heads; contexts 0, 1, bs-1, bs, bs+1, 3bs+5, 300. Split: partitions
    of 3 blocks (24 tokens for 8-token blocks: partitions end inside a key tile), so the long
    sequences split and the short ones do not, in the same launch."""
    scene, query, expected = decode_case(cfg, 8, 2, lengths(cfg))
    out = run_decode(emu(schedule), scene, query, split=split, partition_size=3 * cfg.block_size)
    assert_matches(out, expected, cfg.dtype)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (20, 1)], ids=["group1", "group8", "group20"])
@pytest.mark.parametrize("schedule", ["greedy", "random:7"])
def test_gqa_decode_group_sizes(emu: Any, heads: tuple[int, int], schedule: str) -> None:
    cfg = CONFIGS[0]
    scene, query, expected = decode_case(cfg, *heads, lengths(cfg))
    be = Recorder(emu(schedule))
    out = run_decode(be, scene, query, split=True, partition_size=8 * cfg.block_size)
    assert_matches(out, expected, cfg.dtype)
    num_heads, num_kv_heads = heads
    groups = -(-(num_heads // num_kv_heads) // 16)
    # One CTA per (work item, KV head, 16 query heads): the group shares each K/V load.
    items = sum(max(1, -(-n // (8 * cfg.block_size))) for n in lengths(cfg))
    assert be.launches[0] == ("paged_attention_decode_gqa", (items, num_kv_heads * groups))
    assert be.launches[1] == ("paged_attention_decode_gqa_merge", (num_heads, len(lengths(cfg))))


@pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])
def test_balanced_split_splits_long_sequences_only(emu: Any, schedule: str) -> None:
    """With the default plan (split=None), one long context among short ones: the long one is
    cut into many partitions, the short ones stay whole, all in one launch plus one merge."""
    cfg = CONFIGS[4]
    lens = (3001, 7, 250, 0, 600)
    scene, query, expected = decode_case(cfg, 8, 2, lens)
    be = Recorder(emu(schedule))
    plan = ops.plan_decode_split(lens, 2, be.sm_count, cfg.block_size)
    assert plan.parts[0] > 2 and plan.parts[1:4] == (1, 1, 1)
    out = run_decode(be, scene, query)  # split=None: the balanced plan, from seq_lens
    assert_matches(out, expected, cfg.dtype)
    assert [name for name, _ in be.launches] == ["paged_attention_decode_gqa", "paged_attention_decode_gqa_merge"]
    assert be.launches[0][1] == (plan.num_items, 2)


def test_short_contexts_are_not_split(emu: Any) -> None:
    """Contexts up to GQA_MIN_CHUNK: one launch, one work item per sequence, no merge."""
    cfg = CONFIGS[0]
    lens = tuple(edge_lengths(cfg.block_size, ops.GQA_MIN_CHUNK))
    scene, query, expected = decode_case(cfg, 8, 2, lens)
    be = Recorder(emu("forward"))
    out = run_decode(be, scene, query, seq_lens_host=list(lens))
    assert_matches(out, expected, cfg.dtype)
    assert be.launches == [("paged_attention_decode_gqa", (len(lens), 2))]


def test_plan_decode_split() -> None:
    sms, bs = 132, 16
    target = ops.GQA_CTAS_PER_SM * sms
    # A step that fills the GPU with whole sequences, or whose contexts are all short: no split.
    assert ops.plan_decode_split([4096] * 64, 8, sms, bs).parts == (1,) * 64
    assert ops.plan_decode_split([256, 100, 0], 8, sms, bs).parts == (1, 1, 1)
    assert ops.plan_decode_split([], 8, sms, bs).parts == ()
    for lens, ctas in (([32768, 40, 700, 1], 8), ([5000, 5000], 8), ([100_000], 1), ([3001, 2999], 16)):
        plan = ops.plan_decode_split(lens, ctas, sms, bs)
        chunk = plan.chunk
        assert chunk % bs == 0 and chunk >= ops.GQA_MIN_CHUNK
        assert plan.parts == tuple(max(1, -(-n // chunk)) for n in lens)
        assert plan.num_items * ctas <= target  # about one wave
        # The smallest such chunk: one block less would not fit (or breaks the minimum).
        fewer = sum(max(1, -(-n // (chunk - bs))) for n in lens)
        assert chunk - bs < ops.GQA_MIN_CHUNK or fewer * ctas > target
    mixed = ops.plan_decode_split([32768, 40, 700, 1], 8, sms, bs)
    assert mixed.parts[0] > 1 and mixed.parts[1] == 1 and mixed.parts[3] == 1


def test_seq_lens_host_must_match(emu: Any) -> None:
    cfg = CONFIGS[0]
    scene, query, _ = decode_case(cfg, 8, 2, lengths(cfg))
    with pytest.raises(ValueError, match="seq_lens_host"):
        run_decode(emu("forward"), scene, query, seq_lens_host=[1, 2])


def test_float32_keeps_the_cuda_core_kernel() -> None:
    cfg = AttentionConfig("float32", 32, 8)
    assert decode_module(cfg).source == "decode_attention.cu"
    assert all(decode_module(c).source == "decode_attention_gqa.cu" for c in CONFIGS)
    assert torch.float16 in ops.DTYPE_NAMES and torch.bfloat16 in ops.DTYPE_NAMES


def test_gqa_launch_arguments_and_shapes() -> None:
    """Without running kernels: the decode grid is (work items, KV heads x head groups), every
    scalar a sized numpy type (CuPy packs them by their size), and only split sequences make
    the merge kernel's work (one float of shared memory per partition of the longest)."""
    rec = ApiRecorder()
    k, v = api_cache()
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    args = (torch.empty_like(q), q, k, v, torch.zeros(2, 8, dtype=torch.int32),
            torch.tensor([100, 7], dtype=torch.int32), 0.1)
    ops.paged_attention_decode(*args, split=True, partition_size=32, backend=rec)
    decode, merge = rec.launches
    assert decode["name"].startswith("paged_attention_decode_gqa<") and decode["grid"] == (4 + 1, 2)
    assert decode["block"] == (128,)
    assert all(isinstance(a, np.generic) for a in decode["args"])
    assert decode["args"][11].dtype == np.float32  # scale
    assert all(a.dtype == np.int32 for a in decode["args"][12:-3])  # ..., chunk, window
    assert all(a.dtype == np.float32 for a in decode["args"][-3:])  # soft-cap, k_scale, v_scale
    assert [float(a) for a in decode["args"][-2:]] == [1.0, 1.0]  # a 16-bit cache: no scales
    assert merge["name"].startswith("paged_attention_decode_gqa_merge") and merge["grid"] == (4, 2)
    assert merge["shared_mem"] == 4 * 4
    rec.launches.clear()
    ops.paged_attention_decode(*args, split=False, backend=rec)
    [decode] = rec.launches
    assert decode["grid"] == (2, 2)
    rec.launches.clear()
    ops.paged_attention_decode(*args, seq_lens_host=[100, 7], backend=rec)  # balanced: too short to split
    assert [launch["grid"] for launch in rec.launches] == [(2, 2)]


def test_worker_tokens_match_torch_backend_with_split_decode(
    emu: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """noria's ModelRunner in float16 on the emulated kernels, with the balanced plan allowed
    to split contexts from one block up (GQA_MIN_CHUNK lowered): the decode steps split the
    longer sequences and merge them, and the tokens must still be the torch backend's."""
    from test_worker_kernel_backend import BLOCK_SIZE, OVERRIDES, generate

    from noria.kernels.attention_backend import KernelAttentionBackend
    from noria.worker.attention import TorchAttentionBackend
    from tests.tiny_models import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "llama", **OVERRIDES)
    monkeypatch.setattr(decode_launch, "GQA_MIN_CHUNK", BLOCK_SIZE)
    be = Recorder(emu("forward"))
    got = generate(checkpoint, KernelAttentionBackend(fallback=TorchAttentionBackend(), backend=be), "float16")
    merges = [grid for name, grid in be.launches if name == "paged_attention_decode_gqa_merge"]
    assert merges, "no decode step was split"
    assert got == generate(checkpoint, None, "float16")


def test_unaligned_query_rows_are_copied(emu: Any) -> None:
    """cp.async reads 16-byte query chunks: a query slice that starts 2 bytes into its row
    (or whose row stride is no multiple of 16 bytes) is copied first instead of misread."""
    cfg = CONFIGS[0]
    lens = lengths(cfg)
    scene, aligned, expected = decode_case(cfg, 8, 2, lens)
    d = cfg.head_dim
    rows = torch.zeros(len(lens), 8 * d + 1, dtype=aligned.dtype)
    rows[:, 1:] = aligned.reshape(len(lens), -1)
    query = rows[:, 1:].view(len(lens), 8, d)
    assert query.data_ptr() % 16 and query.stride(0) * query.element_size() % 16
    out = run_decode(emu("forward"), scene, query, split=True, partition_size=3 * cfg.block_size)
    assert_matches(out, expected, cfg.dtype)
