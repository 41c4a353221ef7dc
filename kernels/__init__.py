"""noria's CUDA kernels: paged KV cache writes, paged attention (decode with split-K, ragged
prefill) and batched block copies, compiled at run time by CuPy on a GPU host and run by a
CPU emulator in tests. The Python API lives in kernels.ops; kernels.reference holds the torch
reference of every kernel's contract."""

from __future__ import annotations

import importlib
from typing import Any

_OPS = (
    "choose_num_partitions",
    "copy_blocks",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
)
__all__ = list(_OPS)


def __getattr__(name: str) -> Any:
    # Lazy, so that tools such as `python -m noria.kernels.nvrtc_check` do not import torch.
    if name in _OPS:
        return getattr(importlib.import_module("noria.kernels.ops"), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
