"""Launches of the ragged prefill attention kernels: the tensor-core float16 / bfloat16 kernel
(csrc/prefill_attention_tc.cu) over a step plan's flat work list, and the CUDA-core float32
kernel (csrc/prefill_attention.cu) over a grid of query tiles x heads x sequences. Layouts and
the window / soft-cap contract: ops.py."""

from __future__ import annotations

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.arg_checks import (
    attention_config,
    cache_scales,
    check_attention_args,
    check_int32,
    check_window,
)
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.launch_plan import NUM_THREADS, PREFILL_TILE, StepPlan, plan_step


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    plan: StepPlan | None = None,
    skip_decode: bool = False,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: KernelBackend | None = None,
) -> None:
    """Ragged causal attention: the query tokens query_start_loc[s]:query_start_loc[s+1] of
    sequence s are its last q_len positions (of seq_lens[s]) and attend to every cached
    position up to their own (the last `window` of those with a window). Their K/V must
    already be in the cache.

    float16 / bfloat16 run the tensor-core kernel over a flat work list (from `plan`, else
    from query_start_loc with a device sync); skip_decode (with a plan) leaves the rows of
    one-token sequences unwritten, for the decode kernel. float32 runs the CUDA-core kernel
    over every sequence (max_query_len sizes its grid). An fp8 cache (float8_e4m3fn, with
    float16 / bfloat16 queries: the tensor-core kernel) reads as fp8 * k_scale and
    fp8 * v_scale; other caches ignore the scales."""
    block_size, num_kv_heads, head_dim = check_attention_args(out, query, k_cache, v_cache, block_tables, seq_lens)
    window_args = check_window(window, soft_cap)
    num_tokens, num_heads = query.shape[0], query.shape[1]
    check_int32("query_start_loc", query_start_loc, 1)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    if plan is not None and len(plan.query_lens) != num_seqs:
        raise ValueError(f"the plan has {len(plan.query_lens)} sequences, seq_lens {num_seqs}")
    if num_tokens == 0 or num_seqs == 0:
        return
    be = backend if backend is not None else default_backend(k_cache.device)
    cfg = attention_config(query, k_cache, head_dim, block_size)
    if instances.uses_tc_prefill(cfg):
        if plan is None:
            lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
            plan = plan_step(lens, seq_lens.tolist(), k_cache.device)
        work = plan.work(num_heads // num_kv_heads, skip_decode)
        if work.shape[0] == 0:
            return
        kern = be.kernel(instances.prefill_module(cfg), instances.prefill_tc_name(cfg))
        with be.launch_context(k_cache.device):
            kern(
                (work.shape[0], num_kv_heads),
                (NUM_THREADS,),
                (
                    be.ptr(out), be.ptr(query), be.ptr(k_cache), be.ptr(v_cache), be.ptr(block_tables),
                    be.ptr(seq_lens), be.ptr(query_start_loc), be.ptr(work), np.float32(scale),
                    np.int32(num_heads), np.int32(query.stride(0)), np.int32(block_tables.stride(0)),
                    *window_args, *cache_scales(k_cache, k_scale, v_scale),
                ),
            )
        return
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return
    kern = be.kernel(instances.prefill_module(cfg), instances.prefill_name(cfg))
    tiles = -(-max_query_len // PREFILL_TILE)
    with be.launch_context(k_cache.device):
        kern(
            (tiles, num_heads, num_seqs),
            (NUM_THREADS,),
            (
                be.ptr(out),
                be.ptr(query),
                be.ptr(k_cache),
                be.ptr(v_cache),
                be.ptr(block_tables),
                be.ptr(seq_lens),
                be.ptr(query_start_loc),
                np.float32(scale),
                np.int32(num_kv_heads),
                np.int32(query.stride(0)),
                np.int32(block_tables.stride(0)),
                *window_args,
            ),
        )
