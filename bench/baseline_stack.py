"""The model forward of bench/attention.py's A/B: both sides on the same path.

The native decoder stack (worker/native_stack.py) takes a step only from the working
tree's TorchAttentionBackend, and calls the working tree's attention kernel. A baseline
backend, loaded from another commit, therefore ran its forwards on the modules' Python
path while the working tree's ran in the stack: the "fwd" columns compared paths, not
kernels. Here the baseline's forward runs in the stack as well, with the baseline's own
kernel swapped into the stack's attention pointer. Where that kernel's signature differs
(a commit before the KV write was fused into it) or its backend has no `paged_rows`, both
sides decline the stack and run the Python path instead: slower, but still one path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from noria.worker import cpu_kernels, native_stack

STACK, PYTHON = "native stack", "Python path"


def common_path(baseline: ModuleType) -> str:
    """STACK when the baseline's backend and kernel can run in the current stack, else PYTHON."""
    base, cur = baseline.cpu_kernels.load(), cpu_kernels.load()
    same_abi = (base is not None and cur is not None and native_stack.load() is not None
                and base.paged_decode_f32.argtypes == cur.paged_decode_f32.argtypes)
    return STACK if same_abi and hasattr(baseline.TorchAttentionBackend, "paged_rows") else PYTHON


@contextmanager
def forward_path(path: str, baseline: ModuleType | None) -> Iterator[None]:
    """While open, the model's forward runs on `path`: for the baseline's side (`baseline`
    given) with the baseline's kernel, for the working tree's (None) with its own."""
    saved_rows = native_stack.paged_rows
    loaded = native_stack.load()
    saved_attn = loaded[1].attn if loaded is not None else None

    def rows(backend: Any, meta: Any) -> Any:
        return None if path == PYTHON else backend.paged_rows(meta)

    try:
        if path == PYTHON or baseline is not None:
            native_stack.paged_rows = rows
        if path == STACK and baseline is not None and loaded is not None:
            loaded[1].attn = ctypes.cast(baseline.cpu_kernels.load().paged_decode_f32, ctypes.c_void_p).value
        yield
    finally:
        native_stack.paged_rows = saved_rows
        if loaded is not None:
            loaded[1].attn = saved_attn
