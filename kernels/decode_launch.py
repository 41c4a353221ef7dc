"""Launches of the decode attention kernels, one query token per sequence: the CUDA-core
float32 kernel (csrc/decode_attention.cu, single pass or split-K partitions and a merge) and
the tensor-core float16 / bfloat16 kernel (csrc/decode_attention_gqa.cu, over a work-balanced
plan of sequence partitions and its merge). Layouts and the window / soft-cap contract: ops.py."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.arg_checks import (
    attention_config,
    cache_scales,
    check_attention_args,
    check_window,
)
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.launch_plan import (
    DEFAULT_PARTITION_SIZE,
    GQA_MIN_CHUNK,
    GQA_ROWS,
    NUM_THREADS,
    SINGLE_PARTITION,
    DecodePlan,
    choose_num_partitions,
    plan_decode_split,
    windowed_lengths,
)


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    split: bool | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    seq_lens_host: Sequence[int] | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: KernelBackend | None = None,
) -> None:
    """One query token per sequence: out[s] = softmax(scale * q[s] K^T) V over the first
    seq_lens[s] cached tokens of sequence s (the last `window` of them with a window). An
    empty context gives zeros.

    float16 / bfloat16 run the tensor-core GQA kernel (one CTA per sequence partition, KV head
    and group of up to 16 query heads); split=None splits by work balance
    (plan_decode_split, from seq_lens_host: the host's copy of seq_lens, read from the device
    with a sync if omitted), True splits every sequence longer than partition_size tokens,
    False never splits. float32 runs the CUDA-core kernel: max_seq_len (a host int, at least
    max(seq_lens); computed with a device sync if omitted) sizes its split-K grid, split=None
    lets choose_num_partitions decide, True / False force split-K (partitions of
    partition_size tokens) or a single pass. A window splits by the keys it covers, not the
    context: a long sliding-window context costs its window. An fp8 cache (float8_e4m3fn, with
    float16 / bfloat16 queries) reads as fp8 * k_scale and fp8 * v_scale; other caches ignore
    the scales."""
    block_size, num_kv_heads, head_dim = check_attention_args(out, query, k_cache, v_cache, block_tables, seq_lens)
    window_args = check_window(window, soft_cap)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    if num_seqs == 0:
        return
    if partition_size % block_size != 0:
        raise ValueError("partition_size must be a multiple of the block size")
    cfg = attention_config(query, k_cache, head_dim, block_size)
    be = backend if backend is not None else default_backend(k_cache.device)
    if instances.uses_gqa_decode(cfg):
        plan = _gqa_plan(be, query, k_cache, seq_lens, seq_lens_host, split, partition_size, window)
        _launch_gqa_decode(be, cfg, out, query, k_cache, v_cache, block_tables, seq_lens, scale, plan,
                           (*window_args, *cache_scales(k_cache, k_scale, v_scale)))
        return
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    # Partitions start at the block holding the window's first key, so they cover at most
    # window + block_size - 1 tokens of a context.
    span = max_seq_len if window is None else min(max_seq_len, window + block_size - 1)
    if split is None:
        num_partitions = choose_num_partitions(span, num_seqs, num_heads, be.sm_count, partition_size)
    else:
        num_partitions = max(1, -(-span // partition_size)) if split else 1
    spec = instances.decode_module(cfg)
    decode = be.kernel(spec, instances.decode_name(cfg))
    device = k_cache.device
    common = (
        be.ptr(query), be.ptr(k_cache), be.ptr(v_cache), be.ptr(block_tables), be.ptr(seq_lens),
        np.float32(scale), np.int32(num_kv_heads), np.int32(query.stride(0)), np.int32(block_tables.stride(0)),
    )
    with be.launch_context(device):
        if num_partitions == 1:
            unused = be.ptr(out)  # the partial-result pointers are never touched
            decode(
                (num_heads, num_seqs, 1),
                (NUM_THREADS,),
                (be.ptr(out), unused, unused, unused, *common, np.int32(SINGLE_PARTITION), *window_args),
            )
            return
        _launch_split_decode(
            be, spec, cfg, decode, out, seq_lens, common, num_partitions, partition_size, window_args
        )


def _launch_split_decode(
    be: KernelBackend, spec: ModuleSpec, cfg: AttentionConfig, decode: Any, out: torch.Tensor,
    seq_lens: torch.Tensor, common: tuple[Any, ...], num_partitions: int, partition_size: int,
    window_args: tuple[np.int32, np.float32],
) -> None:
    """Split-K: each partition writes a partial result, then the merge kernel combines them."""
    num_seqs, num_heads, head_dim = out.shape
    device = out.device
    part_out = be.scratch((num_seqs, num_heads, num_partitions, head_dim), device)
    part_max = be.scratch((num_seqs, num_heads, num_partitions), device)
    part_sum = be.scratch((num_seqs, num_heads, num_partitions), device)
    parts = (be.ptr(out), be.ptr(part_out), be.ptr(part_max), be.ptr(part_sum))
    decode((num_heads, num_seqs, num_partitions), (NUM_THREADS,),
           (*parts, *common, np.int32(partition_size), *window_args))
    reduce = be.kernel(spec, instances.reduce_name(cfg))
    smem = 4 * num_partitions
    if smem > 48 * 1024:
        raise ValueError(f"{num_partitions} partitions exceed the merge kernel's shared memory")
    reduce((num_heads, num_seqs), (NUM_THREADS,),
           (*parts, be.ptr(seq_lens), np.int32(num_partitions), np.int32(partition_size),
            np.int32(cfg.block_size), window_args[0]), shared_mem=smem)


def _gqa_plan(
    be: KernelBackend, query: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int] | None, split: bool | None, partition_size: int, window: int | None,
) -> DecodePlan:
    num_seqs, num_heads = query.shape[0], query.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if split is False:
        return DecodePlan(SINGLE_PARTITION, (1,) * num_seqs)
    lens = seq_lens.tolist() if seq_lens_host is None else list(seq_lens_host)
    if len(lens) != num_seqs:
        raise ValueError(f"seq_lens_host has {len(lens)} entries for {num_seqs} sequences")
    lens = windowed_lengths(lens, window)  # the partitions cover the window only
    if split:
        return DecodePlan(partition_size, tuple(max(1, -(-n // partition_size)) for n in lens))
    ctas = num_kv_heads * -(-(num_heads // num_kv_heads) // GQA_ROWS)
    return plan_decode_split(lens, ctas, be.sm_count, block_size, min_chunk=GQA_MIN_CHUNK)


@functools.lru_cache(maxsize=8)
def _work_layout(parts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(work_seq, part_start) of a plan on the device: the sequence of every work item and an
    exclusive prefix sum of the partition counts. Every layer of a step has the same plan, so
    the cache makes this one small host-to-device copy per step."""
    counts = np.asarray(parts, dtype=np.int64)
    part_start = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(counts, out=part_start[1:])
    work_seq = np.repeat(np.arange(len(parts), dtype=np.int32), counts)
    tensors = (torch.from_numpy(work_seq), torch.from_numpy(part_start))
    if device.type == "cuda":  # pinned, so the copies are asynchronous
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)  # type: ignore[return-value]
    return tensors


def _launch_gqa_decode(
    be: KernelBackend, cfg: AttentionConfig, out: torch.Tensor, query: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, plan: DecodePlan, tail_args: tuple[Any, ...],
) -> None:
    """The tensor-core decode kernel over the plan's work items, then the merge kernel for the
    sequences it split. tail_args: (window, soft_cap, k_scale, v_scale)."""
    num_seqs, num_heads, head_dim = out.shape
    num_kv_heads = k_cache.shape[2]
    head_groups = -(-(num_heads // num_kv_heads) // GQA_ROWS)
    device = out.device
    spec = instances.decode_module(cfg)
    if query.data_ptr() % 16 or query.stride(0) * query.element_size() % 16:
        query = query.clone(memory_format=torch.contiguous_format)  # cp.async takes 16-byte rows
    work_seq, part_start = _work_layout(plan.parts, device)
    split = plan.max_parts > 1
    if split:
        smem = 4 * plan.max_parts
        if smem > 48 * 1024:
            raise ValueError(f"{plan.max_parts} partitions exceed the merge kernel's shared memory")
        part_out = be.scratch((plan.num_items, num_heads, head_dim), device)
        part_max = be.scratch((plan.num_items, num_heads), device)
        part_sum = be.scratch((plan.num_items, num_heads), device)
        parts = (be.ptr(out), be.ptr(part_out), be.ptr(part_max), be.ptr(part_sum))
    else:
        unused = be.ptr(out)  # no sequence is split: the partial-result pointers are never touched
        parts = (unused, unused, unused, unused)
    decode = be.kernel(spec, instances.decode_gqa_name(cfg))
    with be.launch_context(device):
        decode(
            (plan.num_items, num_kv_heads * head_groups),
            (NUM_THREADS,),
            (
                *parts, be.ptr(query), be.ptr(k_cache), be.ptr(v_cache), be.ptr(block_tables),
                be.ptr(seq_lens), be.ptr(work_seq), be.ptr(part_start), np.float32(scale),
                np.int32(num_heads), np.int32(num_kv_heads), np.int32(query.stride(0)),
                np.int32(block_tables.stride(0)), np.int32(min(plan.chunk, SINGLE_PARTITION)),
                *tail_args,
            ),
        )
        if split:
            merge = be.kernel(spec, instances.decode_gqa_merge_name(cfg))
            merge((num_heads, num_seqs), (NUM_THREADS,), (*parts, be.ptr(part_start)), shared_mem=smem)
