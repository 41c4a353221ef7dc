"""`noria bench gpu`'s device probes: the copy bandwidth and matmul rate its floors are drawn from."""

from __future__ import annotations

import time
from typing import Any


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def probe_copy_gbps(dev: Any, nbytes: int) -> float:
    """Device copy bandwidth counting bytes read and written (as `noria bench kernels` reports it)."""
    import torch

    if dev.type == "cuda":
        try:
            from noria.kernels.device_info import copy_gbps
        except ImportError:  # the kernels' CuPy side missing: the same copy, timed here
            pass
        else:
            return copy_gbps(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(dev)
    start, n = time.perf_counter(), 5
    for _ in range(n):
        dst.copy_(src)
    sync(dev)
    return 2 * nbytes * n / (time.perf_counter() - start) / 1e9


def probe_matmul_tflops(dev: Any, dtype: Any, n: int) -> float:
    import torch

    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    a @ b
    sync(dev)
    start, iters = time.perf_counter(), 10
    for _ in range(iters):
        a @ b
    sync(dev)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12
