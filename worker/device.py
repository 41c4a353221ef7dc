"""Device and dtype resolution for the worker."""

from __future__ import annotations

import torch

from noria.worker.errors import WorkerFatal

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise WorkerFatal("device 'cuda' was requested but torch on this host sees no CUDA device "
                          "(a CPU-only torch build, or no driver): use --device cpu or auto")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def cpu_precision(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype the model computes in and caches KV in, the dtype its linear weights are kept
    in where that differs). On a CPU, bfloat16 means bf16 weights through the native bf16-weight
    GEMM with float32 activations and KV cache: half float32's weight bytes, which decode reads
    every step, at float32's accuracy; torch's bfloat16 operators (about half float32's speed
    here) only where that GEMM does not build."""
    from noria.protocol import switches
    from noria.worker import gemm_bf16_kernels

    # Under the kernel emulator the CPU stands for a GPU: bf16 stays bf16 for its tensor-core kernels.
    if device.type == "cpu" and dtype == torch.bfloat16 and not switches.emulated_kernels() \
            and gemm_bf16_kernels.load() is not None:
        return torch.float32, torch.bfloat16
    return dtype, None


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto` is float32 on CPU (half-precision matmuls are slow there and break
    parity with transformers); on a GPU it is the checkpoint's own dtype."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    # The checkpoint's own where it is a float dtype the kernels take (config.json spells it as torch does).
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(checkpoint_dtype or "", torch.float32)
