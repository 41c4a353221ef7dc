"""An attention backend over the kernels with the worker's interface (kernels/attention_api.py's
AttentionBackend protocol: prepare(meta) once per step, forward(layer, q, k, v, k_cache,
v_cache, meta) per layer).

The worker's metadata is int64; the kernels take int32 block tables, sequence lengths and
query offsets, converted once per step in prepare(). A layer's sliding window and logit soft-cap go to the
kernels as arguments. `unsupported(layer, dtype, block_size)` says why the kernels cannot run
a layer (a head size, dtype or block size with no instance); such layers go to `fallback` (the worker's torch backend), so no shape
reaches a kernel that was not built for it. `warm_up` compiles the modules a model needs at
start-up instead of at its first step. A decode step that a CUDA graph captures is prepared by
`prepare_graph` instead: persistent buffers and launches fixed per bucket (kernels/graph_plan.py).
An fp8 KV cache (--kv-cache-dtype fp8) is written and read by the kernels with each layer's
k_scale / v_scale; `kv_dtype` (the cache's dtype, given at construction) decides which
instances a layer needs.

`rotary_attention` takes a layer's fused QKV projection instead: it applies rotary to q and k,
writes the cache and attends (three launches of torch operators and a cache write become one
kernel before the attention's). The other fused elementwise kernels are the worker's CUDA ops
(worker/models/ops.py), which call kernels.fused_ops themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from noria.kernels import fused_ops, instances, ops
from noria.kernels.arg_checks import FP8
from noria.kernels.attention_api import AttentionBackend, AttentionMetadata, LayerAttention
from noria.kernels.backends import KernelBackend, default_backend
from noria.kernels.graph_plan import GraphDecode, GraphStep


@dataclass
class _StepTensors:
    block_tables: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32
    max_query_len: int
    max_seq_len: int
    plan: ops.StepPlan  # the step's decode / prefill split and prefill work lists
    fallback_data: Any  # what the fallback's prepare() left in meta.backend_data


def unsupported(layer: LayerAttention, dtype: torch.dtype, block_size: int,
                kv_dtype: torch.dtype | None = None) -> str | None:
    """Why the kernels cannot run `layer` with this model (query) dtype, block size and cache
    dtype (None: the model's), or None when they can."""
    window = layer.sliding_window
    if window is not None and (not isinstance(window, int) or window < 1):
        return f"sliding window {window!r} (kernels: a positive number of tokens)"
    cap = layer.logits_soft_cap
    if cap is not None and not 0.0 < cap < float("inf"):
        return f"logit soft-cap {cap!r} (kernels: a positive finite number)"
    if dtype not in ops.DTYPE_NAMES:
        return f"dtype {dtype} (kernels: {', '.join(ops.DTYPE_NAMES.values())})"
    if layer.head_dim not in instances.HEAD_SIZES:
        return f"head size {layer.head_dim} (kernels: {', '.join(map(str, instances.HEAD_SIZES))})"
    if block_size not in instances.BLOCK_SIZES:
        return f"block size {block_size} (kernels: {', '.join(map(str, instances.BLOCK_SIZES))})"
    if layer.num_kv_heads < 1 or layer.num_heads % layer.num_kv_heads:
        return f"{layer.num_heads} query heads do not group evenly over {layer.num_kv_heads} KV heads"
    if kv_dtype == FP8:
        return instances.fp8_unsupported(ops.DTYPE_NAMES[dtype], layer.head_dim, block_size)
    if kv_dtype is not None and kv_dtype != dtype:
        return f"a {kv_dtype} KV cache under a {dtype} model"
    return None


class KernelAttentionBackend:
    name = "kernels"
    # A graph-captured decode step is prepared by prepare_graph(): fixed launches over
    # persistent buffers (kernels/graph_plan.py), so CUDA graphs may capture it.
    graph_safe = True

    def __init__(self, fallback: AttentionBackend | None = None, backend: KernelBackend | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.fallback = fallback
        self.backend = backend  # None: CuPy for CUDA tensors, the emulator for CPU ones
        self.kv_dtype = kv_dtype  # the KV cache's dtype where it is not the model's (fp8)
        # (layer, dtype, block size, cache dtype) -> why not, or None; decided once per layer shape.
        self._decisions: dict[tuple[LayerAttention, torch.dtype, int, torch.dtype | None], str | None] = {}
        self.graph = GraphDecode(backend)

    def supports(self, layer: LayerAttention, dtype: torch.dtype, block_size: int,
                 kv_dtype: torch.dtype | None = None) -> bool:
        return self.unsupported(layer, dtype, block_size, kv_dtype) is None

    def unsupported(self, layer: LayerAttention, dtype: torch.dtype, block_size: int,
                    kv_dtype: torch.dtype | None = None) -> str | None:
        """unsupported() for a model dtype; the cache's dtype is kv_dtype, else the backend's."""
        key = (layer, dtype, block_size, kv_dtype or self.kv_dtype)
        if key not in self._decisions:
            self._decisions[key] = unsupported(*key)
        return self._decisions[key]

    def _cache_unsupported(self, layer: LayerAttention, dtype: torch.dtype, k_cache: torch.Tensor) -> str | None:
        """unsupported() for a step's tensors: the query's dtype over this cache."""
        return self.unsupported(layer, dtype, k_cache.shape[1], k_cache.dtype)

    def warm_up(self, layers: Sequence[LayerAttention], dtype: torch.dtype, block_size: int, device: torch.device) -> None:
        """Check the backend and compile every module the supported `layers` need, so that a
        missing NVRTC or a compile error shows at start-up, not at the first step."""
        be = self.backend or default_backend(device)
        be.check()
        dtype_name = ops.DTYPE_NAMES.get(dtype)
        if dtype_name is None:
            return
        head_dims = sorted({la.head_dim for la in layers if self.supports(la, dtype, block_size)})
        if not head_dims:
            return
        fp8 = self.kv_dtype == FP8
        specs = [instances.reshape_module(dtype_name, fp8), instances.copy_module(), instances.fused_module(dtype_name)]
        if fp8:
            specs.append(instances.rotary_fp8_module(dtype_name))
        for d in head_dims:
            cfg = instances.AttentionConfig(dtype_name, d, block_size, kv_fp8=fp8)
            specs += [instances.decode_module(cfg), instances.prefill_module(cfg)]
        for spec in specs:
            for name in spec.names:
                be.kernel(spec, name)

    def prepare(self, meta: AttentionMetadata) -> None:
        fallback_data = None
        if self.fallback is not None:
            self.fallback.prepare(meta)
            fallback_data = meta.backend_data
        meta.backend_data = _StepTensors(
            block_tables=meta.block_tables.to(torch.int32),
            seq_lens=meta.seq_lens.to(torch.int32),
            query_start_loc=meta.query_start_loc.to(torch.int32),
            max_query_len=max(meta.query_lens_host),
            max_seq_len=max(meta.seq_lens_host),
            plan=ops.plan_step(meta.query_lens_host, meta.seq_lens_host, meta.seq_lens.device),
            fallback_data=fallback_data,
        )

    def prepare_graph(self, meta: AttentionMetadata) -> None:
        """prepare() for a decode step a CUDA graph captures or replays (worker/cuda_graphs.py):
        meta's tensors are the persistent buffers at the bucket's size and the full table width,
        and its host lengths are not the step's. The step's tables and lengths are copied into
        persistent int32 buffers on the device and every launch is fixed for the bucket."""
        fallback_data = None
        if self.fallback is not None:
            self.fallback.prepare(meta)
            fallback_data = meta.backend_data
        step = self.graph.prepare(meta.block_tables, meta.seq_lens, meta.block_size)
        step.fallback_data = fallback_data
        meta.backend_data = step

    def copy_blocks(self, src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        """Swaps for worker.kv_cache.KVCache.block_copier: one launch."""
        ops.copy_blocks(src_caches, dst_caches, block_mapping, backend=self.backend)

    def forward(
        self,
        layer: LayerAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        step: _StepTensors | GraphStep = meta.backend_data
        why = self._cache_unsupported(layer, q.dtype, k_cache)
        if why is not None:
            if self.fallback is None:
                raise NotImplementedError(f"no kernel for this layer: {why}")
            meta.backend_data = step.fallback_data
            try:
                return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
            finally:
                meta.backend_data = step
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=layer.k_scale,
                              v_scale=layer.v_scale, backend=self.backend)
        return self._attend(layer, q, k_cache, v_cache, step)

    def rotary_attention(
        self,
        layer: LayerAttention,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Attention of a layer from its fused QKV projection [tokens, (H + 2 KVH) D]: rotary
        on q and k in place with the cache write in one kernel, then the attention kernel.
        None (nothing done) for a layer the kernels do not run; the caller takes the
        unfused path, whose forward() goes to the fallback."""
        if self._cache_unsupported(layer, qkv.dtype, k_cache) is not None:
            return None
        q, _, _ = fused_ops.rotary_qkv_cache(
            qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, layer.num_heads, k_scale=layer.k_scale,
            v_scale=layer.v_scale, backend=self.backend
        )
        return self._attend(layer, q, k_cache, v_cache, meta.backend_data)

    def _attend(
        self, layer: LayerAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        step: _StepTensors | GraphStep,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if isinstance(step, GraphStep):
            step.attend(out, q, k_cache, v_cache, layer.scale, window=layer.sliding_window,
                        soft_cap=layer.logits_soft_cap, k_scale=layer.k_scale, v_scale=layer.v_scale)
            return out
        ops.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            step.query_start_loc,
            layer.scale,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            plan=step.plan,
            window=layer.sliding_window,
            soft_cap=layer.logits_soft_cap,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            backend=self.backend,
        )
        return out
