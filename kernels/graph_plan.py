"""Decode attention whose launches a CUDA graph can replay: fixed grids, fixed arguments.

A captured graph replays the launches of one decode forward pass with the grids and
arguments they had at capture, so for a bucket of B rows (worker/cuda_graphs.py) nothing
the decode kernels take may come from the step's lengths on the host. As vLLM's and
FlashInfer's graph-mode decode keep their metadata:

* the int32 block tables and context lengths live in persistent buffers (the largest
  bucket x the full block-table width); each step refills the rows it uses with one device
  copy from the worker's persistent int64 buffers, a copy the graph replays too;
* the split-K partition count is fixed per bucket and layer shape, chosen once with the
  eager planners' rules (`choose_num_partitions`, `plan_decode_split`) for rows that all
  have the longest context a row may have (the table width x the block size) on this GPU's
  SM count, so that no step needs more. A shorter context leaves its trailing partitions
  empty: the float32 kernel returns early for them and its merge counts partitions from the
  length on the device; the tensor-core kernel writes an empty partial (max -inf, sum 0,
  zeros) that its merge weighs by zero;
* the tensor-core kernel's work tables (each item's sequence, each sequence's first item)
  depend only on (B, partitions): built once, on the device;
* the split-K partials are persistent, one float32 buffer shared by every bucket and layer
  (their launches run in stream order).

Padded rows (length 1 and a null-block table, worker/cuda_graphs.pad_decode) attend to the
one key the step wrote into the null block; their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from noria.kernels import instances, ops
from noria.kernels.arg_checks import (
    attention_config,
    cache_scales,
    check_attention_args,
    check_window,
)
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.instances import AttentionConfig
from noria.kernels.launch_plan import (
    DEFAULT_PARTITION_SIZE,
    GQA_MIN_CHUNK,
    SINGLE_PARTITION,
    choose_num_partitions,
    plan_decode_split,
)


@dataclass(frozen=True)
class FixedSplit:
    parts: int  # partitions per sequence, the same on every step
    size: int  # tokens per partition (SINGLE_PARTITION when there is one)


def fixed_split(
    cfg: AttentionConfig, rows: int, max_len: int, num_heads: int, num_kv_heads: int, sm_count: int,
    window: int | None = None,
) -> FixedSplit:
    """The split a bucket of `rows` decode rows keeps on every step: what the eager planner
    gives rows that all have the longest possible context `max_len` (counting only what a
    sliding window covers), the most work a step of this bucket can bring."""
    if instances.uses_gqa_decode(cfg):
        span = max_len if window is None else min(max_len, window)
        ctas = num_kv_heads * -(-(num_heads // num_kv_heads) // ops.GQA_ROWS)
        plan = plan_decode_split([span] * rows, ctas, sm_count, cfg.block_size, min_chunk=GQA_MIN_CHUNK)
        if plan.max_parts == 1:
            return FixedSplit(1, SINGLE_PARTITION)
        return FixedSplit(plan.max_parts, plan.chunk)
    # Float32 partitions start at the block holding a window's first key.
    span = max_len if window is None else min(max_len, window + cfg.block_size - 1)
    parts = choose_num_partitions(span, rows, num_heads, sm_count, DEFAULT_PARTITION_SIZE)
    return FixedSplit(parts, DEFAULT_PARTITION_SIZE if parts > 1 else SINGLE_PARTITION)


@dataclass
class _Launch:
    """Everything one (bucket, layer shape) passes to its kernels besides the activations."""

    split: FixedSplit
    part_out: torch.Tensor | None = None
    part_max: torch.Tensor | None = None
    part_sum: torch.Tensor | None = None
    work_seq: torch.Tensor | None = None  # tensor-core kernel: [rows * parts]
    part_start: torch.Tensor | None = None  # [rows + 1]


@dataclass(eq=False)
class GraphStep:
    """A graph-mode decode step's attention data (meta.backend_data): views of the persistent
    int32 buffers at the bucket's size."""

    owner: GraphDecode
    rows: int
    max_len: int  # the longest context a row may have: the table width x the block size
    block_tables: torch.Tensor  # int32 [rows, cols]
    seq_lens: torch.Tensor  # int32 [rows]
    fallback_data: Any = None  # what a fallback backend's prepare() left in meta.backend_data

    def attend(
        self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float, *, window: int | None = None, soft_cap: float | None = None, k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self.owner.attend(self, out, query, k_cache, v_cache, scale, window=window, soft_cap=soft_cap,
                          k_scale=k_scale, v_scale=v_scale)


@dataclass(eq=False)
class GraphDecode:
    """The persistent buffers and fixed launches of graph-mode decode steps, for every bucket."""

    backend: KernelBackend | None = None  # None: CuPy for CUDA tensors, the emulator for CPU ones
    # (rows, cols, device) -> the int32 tables and lengths that bucket reads.
    _rows: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _tables: torch.Tensor | None = None
    _lens: torch.Tensor | None = None
    _scratch: torch.Tensor | None = None
    _launches: dict[tuple[Any, ...], _Launch] = field(default_factory=dict)

    def prepare(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> GraphStep:
        """Copy a step's int64 tables and lengths ([rows, cols], [rows]) into the bucket's int32
        buffers; the returned step's attend() launches with arguments fixed for the bucket."""
        rows, cols = block_tables.shape
        tables, lens = self._buffers(rows, cols, block_tables.device)
        tables.copy_(block_tables)
        lens.copy_(seq_lens)
        return GraphStep(self, rows, cols * block_size, tables, lens)

    def _buffers(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, cols, str(device))
        if key not in self._rows:
            t = self._tables
            if t is None or t.shape[0] < rows or t.shape[1] != cols or t.device != device:
                # Buckets are captured largest first, so this is one allocation; a bucket that
                # was already given rows of an older buffer keeps them (held in self._rows).
                self._tables = torch.zeros((rows, cols), dtype=torch.int32, device=device)
                self._lens = torch.ones(rows, dtype=torch.int32, device=device)
            assert self._tables is not None and self._lens is not None
            self._rows[key] = (self._tables[:rows], self._lens[:rows])
        return self._rows[key]

    def _scratch_view(self, be: KernelBackend, numel: int, device: torch.device) -> torch.Tensor:
        s = self._scratch
        if s is None or s.numel() < numel or s.device != device:
            # Views handed out earlier keep an older buffer alive for the graphs that read it.
            self._scratch = s = be.scratch((numel,), device)
        return s[:numel]

    def _launch(self, be: KernelBackend, step: GraphStep, cfg: AttentionConfig, num_heads: int,
                num_kv_heads: int, window: int | None, device: torch.device) -> _Launch:
        key = (step.rows, step.max_len, cfg, num_heads, num_kv_heads, window, str(device))
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        split = fixed_split(cfg, step.rows, step.max_len, num_heads, num_kv_heads, be.sm_count, window)
        launch = _Launch(split)
        if split.parts > 1:
            if 4 * split.parts > 48 * 1024:
                raise ValueError(f"{split.parts} partitions exceed the merge kernel's shared memory")
            items, d = step.rows * split.parts, cfg.head_dim
            flat = self._scratch_view(be, items * num_heads * (d + 2), device)
            n = items * num_heads
            launch.part_out = flat[: n * d]
            launch.part_max = flat[n * d : n * d + n]
            launch.part_sum = flat[n * d + n : n * (d + 2)]
        if instances.uses_gqa_decode(cfg):
            # On the device from arange, so building them needs no host copy (and would be
            # capturable too); their contents never change.
            parts = split.parts
            launch.work_seq = torch.div(torch.arange(step.rows * parts, dtype=torch.int32, device=device), parts,
                                        rounding_mode="floor")
            launch.part_start = torch.arange(step.rows + 1, dtype=torch.int32, device=device) * parts
        self._launches[key] = launch
        return launch

    def attend(
        self, step: GraphStep, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, scale: float, *, window: int | None = None, soft_cap: float | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """One query per row (rows = the bucket size): out[s] = attention of query[s] over the
        first seq_lens[s] keys of row s, as ops.paged_attention_decode computes it (an fp8
        cache read with its scales)."""
        block_size, num_kv_heads, head_dim = check_attention_args(
            out, query, k_cache, v_cache, step.block_tables, step.seq_lens)
        window_args = check_window(window, soft_cap)
        if window is not None and window >= 1 << 30:
            window = None  # as check_window: a window no context reaches
        rows, num_heads = query.shape[0], query.shape[1]
        if rows != step.rows:
            raise ValueError(f"{rows} query rows for a bucket of {step.rows}")
        device = k_cache.device
        be = self.backend or default_backend(device)
        cfg = attention_config(query, k_cache, head_dim, block_size)
        launch = self._launch(be, step, cfg, num_heads, num_kv_heads, window, device)
        split = launch.split
        spec = instances.decode_module(cfg)
        if split.parts > 1:
            assert launch.part_out is not None and launch.part_max is not None and launch.part_sum is not None
            partials = (be.ptr(out), be.ptr(launch.part_out), be.ptr(launch.part_max), be.ptr(launch.part_sum))
        else:
            unused = be.ptr(out)  # one partition: the kernels never touch the partial pointers
            partials = (unused, unused, unused, unused)
        smem = 4 * split.parts
        if instances.uses_gqa_decode(cfg):
            if query.data_ptr() % 16 or query.stride(0) * query.element_size() % 16:
                query = query.clone(memory_format=torch.contiguous_format)  # cp.async takes 16-byte rows
            assert launch.work_seq is not None and launch.part_start is not None
            head_groups = -(-(num_heads // num_kv_heads) // ops.GQA_ROWS)
            decode = be.kernel(spec, instances.decode_gqa_name(cfg))
            with be.launch_context(device):
                decode(
                    (rows * split.parts, num_kv_heads * head_groups),
                    (ops.NUM_THREADS,),
                    (
                        *partials, be.ptr(query), be.ptr(k_cache), be.ptr(v_cache), be.ptr(step.block_tables),
                        be.ptr(step.seq_lens), be.ptr(launch.work_seq), be.ptr(launch.part_start),
                        np.float32(scale), np.int32(num_heads), np.int32(num_kv_heads), np.int32(query.stride(0)),
                        np.int32(step.block_tables.stride(0)), np.int32(split.size), *window_args,
                        *cache_scales(k_cache, k_scale, v_scale),
                    ),
                )
                if split.parts > 1:
                    merge = be.kernel(spec, instances.decode_gqa_merge_name(cfg))
                    merge((num_heads, rows), (ops.NUM_THREADS,), (*partials, be.ptr(launch.part_start)),
                          shared_mem=smem)
            return
        decode = be.kernel(spec, instances.decode_name(cfg))
        with be.launch_context(device):
            decode(
                (num_heads, rows, split.parts),
                (ops.NUM_THREADS,),
                (
                    *partials, be.ptr(query), be.ptr(k_cache), be.ptr(v_cache), be.ptr(step.block_tables),
                    be.ptr(step.seq_lens), np.float32(scale), np.int32(num_kv_heads), np.int32(query.stride(0)),
                    np.int32(step.block_tables.stride(0)), np.int32(split.size), *window_args,
                ),
            )
            if split.parts > 1:
                reduce = be.kernel(spec, instances.reduce_name(cfg))
                reduce(
                    (num_heads, rows),
                    (ops.NUM_THREADS,),
                    (*partials, be.ptr(step.seq_lens), np.int32(split.parts), np.int32(split.size),
                     np.int32(block_size), window_args[0]),
                    shared_mem=smem,
                )
