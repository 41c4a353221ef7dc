"""Python API over the kernels: shape checks, launch configuration and the split-K choice.

Tensors are torch tensors. CUDA tensors run through CuPy on torch's current stream; CPU
tensors run under the CPU emulator (tests), unless a backend is given. Layouts:

* KV cache (per layer, K and V alike): [num_blocks, block_size, num_kv_heads, head_dim].
* query / key / value rows: [tokens, heads, head_dim] with heads and head_dim contiguous; the
  token stride is free, so slices of a fused QKV projection can be passed as they are.
* block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs] (context length
  including this step's tokens); query_start_loc int32 [num_seqs + 1]; slot_mapping int32 or
  int64 [num_tokens] with slot = block * block_size + offset, negative = skip.

Every attention entry point takes `window` (sliding window: a query at position p sees keys
p - window + 1 .. p, as transformers' sliding-window layers; None = the whole context) and
`soft_cap` (scores s = scale * q.k become soft_cap * tanh(s / soft_cap) before the softmax, as
Gemma 2's attention logit soft-capping; None = off).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.instances import AttentionConfig, ModuleSpec

# Re-exported: callers and tests name them as ops.X (and patch ops.GQA_MIN_CHUNK).
from noria.kernels.launch_plan import (  # noqa: F401
    DEFAULT_PARTITION_SIZE,
    GQA_CTAS_PER_SM,
    GQA_MIN_CHUNK,
    PREFILL_TC_ROWS,
    SINGLE_PARTITION,
    SPLIT_MIN_CONTEXT,
    DecodePlan,
    StepPlan,
    choose_num_partitions,
    plan_decode_split,
    plan_step,
    prefill_work_items,
    windowed_lengths,
)

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SLOT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
NUM_THREADS = 128  # decode, reduce and prefill kernels are written for 4 warps
PREFILL_TILE = 16  # query rows per CUDA-core (float32) prefill CTA
GQA_ROWS = 16  # query heads per CTA of the tensor-core decode kernel (the mma's M)


def _dtype_name(t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {t.dtype}; one of {list(DTYPE_NAMES)}") from None


def _check_rows(name: str, t: torch.Tensor, heads: int, head_dim: int) -> None:
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != head_dim:
        raise ValueError(f"{name} must be [tokens, {heads}, {head_dim}], got {tuple(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != head_dim:
        raise ValueError(f"{name}: heads and head_dim must be contiguous, strides {t.stride()}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] "
            f"of one dtype, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return block_size, num_kv_heads, head_dim


def _check_int32(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype != torch.int32 or t.dim() != ndim:
        raise ValueError(f"{name} must be an int32 tensor with {ndim} dims")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _backend(t: torch.Tensor, backend: KernelBackend | None) -> KernelBackend:
    return backend if backend is not None else default_backend(t.device)


def _window_args(window: int | None, soft_cap: float | None) -> tuple[np.int32, np.float32]:
    """The kernels' (window, soft_cap) arguments; 0 turns either off."""
    if window is not None and (not isinstance(window, int | np.integer) or window < 1):
        raise ValueError(f"window must be a positive number of tokens or None, got {window!r}")
    if soft_cap is not None and not (0.0 < float(soft_cap) < float("inf")):
        raise ValueError(f"soft_cap must be a positive finite number or None, got {soft_cap!r}")
    if window is not None and window >= 1 << 30:
        window = None  # a window no context reaches
    return np.int32(window or 0), np.float32(soft_cap or 0.0)


def _threads_for(elems: int, cap: int = 256) -> int:
    return max(32, min(cap, (elems + 31) // 32 * 32))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: KernelBackend | None = None,
) -> None:
    """Write key[t] / value[t] ([tokens, num_kv_heads, head_dim]) into slot slot_mapping[t]."""
    _, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    _check_rows("key", key, num_kv_heads, head_dim)
    _check_rows("value", value, num_kv_heads, head_dim)
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise TypeError("key, value and the caches must share one dtype")
    if slot_mapping.dtype not in SLOT_DTYPES or slot_mapping.dim() != 1:
        raise ValueError("slot_mapping must be a 1-D int32 or int64 tensor")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError("key, value and slot_mapping disagree on the number of tokens")
    if num_tokens == 0:
        return  # a zero-sized grid is a launch error on a GPU
    be = _backend(k_cache, backend)
    dtype = _dtype_name(k_cache)
    spec = instances.reshape_module(dtype)
    kern = be.kernel(spec, instances.reshape_name(dtype, SLOT_DTYPES[slot_mapping.dtype]))
    row = num_kv_heads * head_dim
    with be.launch_context(k_cache.device):
        kern(
            (num_tokens,),
            (_threads_for(row),),
            (
                be.ptr(key),
                be.ptr(value),
                be.ptr(k_cache),
                be.ptr(v_cache),
                be.ptr(slot_mapping.contiguous()),
                np.int32(key.stride(0)),
                np.int32(value.stride(0)),
                np.int32(row),
            ),
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
    context: a long sliding-window context costs its window."""
    block_size, num_kv_heads, head_dim = _check_decode_args(out, query, k_cache, v_cache, block_tables, seq_lens)
    window_args = _window_args(window, soft_cap)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    if num_seqs == 0:
        return
    if partition_size % block_size != 0:
        raise ValueError("partition_size must be a multiple of the block size")
    cfg = AttentionConfig(_dtype_name(k_cache), head_dim, block_size)
    if instances.uses_gqa_decode(cfg):
        be = _backend(k_cache, backend)
        plan = _gqa_plan(be, query, k_cache, seq_lens, seq_lens_host, split, partition_size, window)
        _launch_gqa_decode(be, cfg, out, query, k_cache, v_cache, block_tables, seq_lens, scale, plan, window_args)
        return
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    # Partitions start at the block holding the window's first key, so they cover at most
    # window + block_size - 1 tokens of a context.
    span = max_seq_len if window is None else min(max_seq_len, window + block_size - 1)
    be = _backend(k_cache, backend)
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
    backend: KernelBackend | None = None,
) -> None:
    """Ragged causal attention: the query tokens query_start_loc[s]:query_start_loc[s+1] of
    sequence s are its last q_len positions (of seq_lens[s]) and attend to every cached
    position up to their own (the last `window` of those with a window). Their K/V must
    already be in the cache.

    float16 / bfloat16 run the tensor-core kernel over a flat work list (from `plan`, else
    from query_start_loc with a device sync); skip_decode (with a plan) leaves the rows of
    one-token sequences unwritten, for the decode kernel. float32 runs the CUDA-core kernel
    over every sequence (max_query_len sizes its grid)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    window_args = _window_args(window, soft_cap)
    num_tokens, num_heads = query.shape[0], query.shape[1]
    _check_rows("query", query, num_heads, head_dim)
    if out.shape != (num_tokens, num_heads, head_dim) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_tokens}, {num_heads}, {head_dim}] tensor")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads}")
    _check_int32("block_tables", block_tables, 2)
    _check_int32("seq_lens", seq_lens, 1)
    _check_int32("query_start_loc", query_start_loc, 1)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    if plan is not None and len(plan.query_lens) != num_seqs:
        raise ValueError(f"the plan has {len(plan.query_lens)} sequences, seq_lens {num_seqs}")
    if num_tokens == 0 or num_seqs == 0:
        return
    be = _backend(k_cache, backend)
    cfg = AttentionConfig(_dtype_name(k_cache), head_dim, block_size)
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
                    *window_args,
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


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    plan: StepPlan | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    backend: KernelBackend | None = None,
) -> None:
    """One step's attention. Every sequence brings one token: the decode kernel (query row s is
    sequence s). A mixed step with a plan and a 16-bit cache: the decode kernel over the
    one-token sequences and the tensor-core prefill kernel over the others, neither launching a
    CTA for the other's rows. Otherwise (no plan, or float32) the ragged prefill kernel over
    everything; it computes decode rows too."""
    if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
        paged_attention_decode(
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            max_seq_len=max_seq_len,
            seq_lens_host=plan.seq_lens if plan is not None else None,
            window=window,
            soft_cap=soft_cap,
            backend=backend,
        )
        return
    mixed = (
        plan is not None
        and plan.decode_seq_index is not None
        and DTYPE_NAMES.get(k_cache.dtype) in instances.TENSOR_CORE_DTYPES
    )
    paged_attention_prefill(
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=max_query_len,
        plan=plan,
        skip_decode=mixed,
        window=window,
        soft_cap=soft_cap,
        backend=backend,
    )
    if mixed:
        assert plan is not None
        _decode_rows(out, query, k_cache, v_cache, block_tables, seq_lens, scale, plan, backend,
                     window=window, soft_cap=soft_cap)


def _decode_rows(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, plan: StepPlan,
    backend: KernelBackend | None, *, window: int | None, soft_cap: float | None,
) -> None:
    """The decode kernel over a mixed step's one-token sequences: views of the step's tensors
    when those sequences are consecutive, else gathered rows scattered back into `out`."""
    seqs, tokens = plan.decode_seq_index, plan.decode_token_index
    lens_host = [plan.seq_lens[s] for s in plan.decode_seqs]
    if isinstance(seqs, slice) and isinstance(tokens, slice):
        paged_attention_decode(
            out[tokens], query[tokens], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale,
            max_seq_len=max(lens_host), seq_lens_host=lens_host, window=window, soft_cap=soft_cap,
            backend=backend,
        )
        return
    assert isinstance(seqs, torch.Tensor) and isinstance(tokens, torch.Tensor)
    dec_out = torch.empty((len(lens_host), *out.shape[1:]), dtype=out.dtype, device=out.device)
    paged_attention_decode(
        dec_out, query.index_select(0, tokens), k_cache, v_cache, block_tables.index_select(0, seqs),
        seq_lens.index_select(0, seqs), scale, max_seq_len=max(lens_host), seq_lens_host=lens_host,
        window=window, soft_cap=soft_cap, backend=backend,
    )
    out.index_copy_(0, tokens, dec_out)


def copy_unit(block_bytes: int, addresses: Sequence[int]) -> int:
    """16-byte copies when every block start is 16-byte aligned, else 4-byte ones."""
    for unit in (16, 4):
        if block_bytes % unit == 0 and all(a % unit == 0 for a in addresses):
            return unit
    raise ValueError("cache blocks must be 4-byte aligned")


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    backend: KernelBackend | None = None,
) -> None:
    """dst_caches[c][dst] = src_caches[c][src] for every (src, dst) row of block_mapping
    ([pairs, 2]) and every cache c, in one launch. Swap-out: GPU caches -> pinned CPU caches;
    swap-in: the reverse; a device-to-device copy: the same caches on both sides. No block may be both
    a source and a destination of one call."""
    if len(src_caches) != len(dst_caches) or not src_caches:
        raise ValueError("src_caches and dst_caches must be equally long and non-empty")
    block_bytes = {t[0].numel() * t.element_size() for t in (*src_caches, *dst_caches)}
    if len(block_bytes) != 1:
        raise ValueError("every cache must have the same bytes per block")
    if any(not t.is_contiguous() for t in (*src_caches, *dst_caches)):
        raise ValueError("caches must be contiguous")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError("block_mapping must be [pairs, 2]")
    pairs = block_mapping.shape[0]
    if pairs == 0:
        return
    nbytes = block_bytes.pop()
    unit = copy_unit(nbytes, [t.data_ptr() for t in (*src_caches, *dst_caches)])
    # The launch runs where the GPU caches are (for a swap, one side is pinned CPU memory).
    run_on = next((t for t in (*src_caches, *dst_caches) if t.is_cuda), src_caches[0])
    be = _backend(run_on, backend)
    device = run_on.device
    src_table = be.pointer_table(src_caches, device)
    dst_table = be.pointer_table(dst_caches, device)
    mapping = block_mapping.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    units = nbytes // unit
    kern = be.kernel(instances.copy_module(), instances.copy_name(unit))
    with be.launch_context(device):
        kern(
            (pairs, len(src_caches)),
            (_threads_for(units),),
            (be.ptr(src_table), be.ptr(dst_table), be.ptr(mapping), np.int64(units)),
        )


def _check_decode_args(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor,
) -> tuple[int, int, int]:
    """The decode contract's shape checks; returns (block_size, num_kv_heads, head_dim)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    _check_rows("query", query, num_heads, head_dim)
    if out.shape != (num_seqs, num_heads, head_dim) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_seqs}, {num_heads}, {head_dim}] tensor")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads}")
    _check_int32("block_tables", block_tables, 2)
    _check_int32("seq_lens", seq_lens, 1)
    return block_size, num_kv_heads, head_dim


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
    seq_lens: torch.Tensor, scale: float, plan: DecodePlan, window_args: tuple[np.int32, np.float32],
) -> None:
    """The tensor-core decode kernel over the plan's work items, then the merge kernel for the
    sequences it split."""
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
                *window_args,
            ),
        )
        if split:
            merge = be.kernel(spec, instances.decode_gqa_merge_name(cfg))
            merge((num_heads, num_seqs), (NUM_THREADS,), (*parts, be.ptr(part_start)), shared_mem=smem)
