"""Python API over the attention and cache kernels: one step's attention (`paged_attention`,
which picks the decode and prefill launches) and the names callers use, gathered from the
files that hold them: argument checks (arg_checks.py), decode and prefill launches
(decode_launch.py, prefill_launch.py), the cache write and block copies (cache_ops.py) and
the host-side launch plans (launch_plan.py).

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

import torch

from noria.kernels import instances
from noria.kernels.arg_checks import DTYPE_NAMES, SLOT_DTYPES
from noria.kernels.backends import KernelBackend
from noria.kernels.cache_ops import copy_blocks, copy_unit, reshape_and_cache
from noria.kernels.decode_launch import paged_attention_decode
from noria.kernels.launch_plan import (
    DEFAULT_PARTITION_SIZE,
    GQA_CTAS_PER_SM,
    GQA_MIN_CHUNK,
    GQA_ROWS,
    NUM_THREADS,
    PREFILL_TC_ROWS,
    PREFILL_TILE,
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
from noria.kernels.prefill_launch import paged_attention_prefill

# Callers and tests name all of these as ops.X. The constants are read where they are used, so
# a test that lowers GQA_MIN_CHUNK patches decode_launch, not this module.
__all__ = [
    "DEFAULT_PARTITION_SIZE",
    "DTYPE_NAMES",
    "GQA_CTAS_PER_SM",
    "GQA_MIN_CHUNK",
    "GQA_ROWS",
    "NUM_THREADS",
    "PREFILL_TC_ROWS",
    "PREFILL_TILE",
    "SINGLE_PARTITION",
    "SLOT_DTYPES",
    "SPLIT_MIN_CONTEXT",
    "DecodePlan",
    "StepPlan",
    "choose_num_partitions",
    "copy_blocks",
    "copy_unit",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "plan_decode_split",
    "plan_step",
    "prefill_work_items",
    "reshape_and_cache",
    "windowed_lengths",
]


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: KernelBackend | None = None,
) -> None:
    """One step's attention. Every sequence brings one token: the decode kernel (query row s is
    sequence s). A mixed step with a plan and a 16-bit cache: the decode kernel over the
    one-token sequences and the tensor-core prefill kernel over the others, neither launching a
    CTA for the other's rows. Otherwise (no plan, or float32) the ragged prefill kernel over
    everything; it computes decode rows too. An fp8 cache reads as fp8 * k_scale and
    fp8 * v_scale (other caches ignore the scales)."""
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
            k_scale=k_scale,
            v_scale=v_scale,
            backend=backend,
        )
        return
    mixed = (
        plan is not None
        and plan.decode_seq_index is not None
        and DTYPE_NAMES.get(query.dtype) in instances.TENSOR_CORE_DTYPES
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
        k_scale=k_scale,
        v_scale=v_scale,
        backend=backend,
    )
    if mixed:
        assert plan is not None
        _decode_rows(out, query, k_cache, v_cache, block_tables, seq_lens, scale, plan, backend,
                     window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)


def _decode_rows(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, plan: StepPlan,
    backend: KernelBackend | None, *, window: int | None, soft_cap: float | None, k_scale: float,
    v_scale: float,
) -> None:
    """The decode kernel over a mixed step's one-token sequences: views of the step's tensors
    when those sequences are consecutive, else gathered rows scattered back into `out`."""
    seqs, tokens = plan.decode_seq_index, plan.decode_token_index
    lens_host = [plan.seq_lens[s] for s in plan.decode_seqs]
    if isinstance(seqs, slice) and isinstance(tokens, slice):
        paged_attention_decode(
            out[tokens], query[tokens], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale,
            max_seq_len=max(lens_host), seq_lens_host=lens_host, window=window, soft_cap=soft_cap,
            k_scale=k_scale, v_scale=v_scale, backend=backend,
        )
        return
    assert isinstance(seqs, torch.Tensor) and isinstance(tokens, torch.Tensor)
    dec_out = torch.empty((len(lens_host), *out.shape[1:]), dtype=out.dtype, device=out.device)
    paged_attention_decode(
        dec_out, query.index_select(0, tokens), k_cache, v_cache, block_tables.index_select(0, seqs),
        seq_lens.index_select(0, seqs), scale, max_seq_len=max(lens_host), seq_lens_host=lens_host,
        window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, backend=backend,
    )
    out.index_copy_(0, tokens, dec_out)
