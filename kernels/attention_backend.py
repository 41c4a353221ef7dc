"""An attention backend over the kernels with the worker's interface (worker.attention's
AttentionBackend protocol: prepare(meta) once per step, forward(layer, q, k, v, k_cache,
v_cache, meta) per layer). It only reads attributes, so kernels/ does not import worker/.

The worker's metadata is int64; the kernels take int32 block tables, sequence lengths and
query offsets, converted once per step in prepare(). Layers with a sliding window are not
supported by the kernels and go to `fallback` (the worker's torch backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from noria.kernels import ops
from noria.kernels.backends import KernelBackend


@dataclass
class _StepTensors:
    block_tables: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32
    max_query_len: int
    max_seq_len: int
    fallback_data: Any  # what the fallback's prepare() left in meta.backend_data


class KernelAttentionBackend:
    name = "kernels"

    def __init__(self, fallback: Any = None, backend: KernelBackend | None = None) -> None:
        self.fallback = fallback
        self.backend = backend  # None: CuPy for CUDA tensors, the emulator for CPU ones

    def prepare(self, meta: Any) -> None:
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
            fallback_data=fallback_data,
        )

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        step: _StepTensors = meta.backend_data
        if getattr(layer, "sliding_window", None) is not None:
            if self.fallback is None:
                raise NotImplementedError("the kernels have no sliding-window attention")
            meta.backend_data = step.fallback_data
            try:
                return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
            finally:
                meta.backend_data = step
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
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
            backend=self.backend,
        )
        return out
