"""Which attention backend the worker uses, decided once at start-up, per layer.

On a CUDA device the CuPy kernels (noria.kernels) run every layer whose shapes, dtype and
block size they were built for; the torch backend runs the rest. When CuPy is missing or
broken (no wheel, a wheel for another CUDA major, no NVRTC, a kernel that does not compile)
every layer runs on torch. Either way the worker logs one line saying what and why, and no
step ever reaches a kernel that was not built for its shapes. `--attention-backend kernels`
turns that fallback into a start-up error; `--attention-backend torch` skips the kernels.
An fp8 KV cache (--kv-cache-dtype fp8) is read and written by the kernels for float16 / bfloat16
models at the head sizes and block sizes they have fp8 instances for; other layers run on
torch, which reads fp8 too, with the reason in the same log line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from noria.protocol import switches
from noria.protocol.config import AttentionBackendChoice
from noria.worker.attention import AttentionBackend, LayerAttention, TorchAttentionBackend
from noria.worker.errors import WorkerFatal

if TYPE_CHECKING:
    from noria.kernels.attention_backend import KernelAttentionBackend

log = logging.getLogger("noria.worker")

CUDA_INSTALL_HINT = "pip install noria[cuda]"
# Set to 1, a CPU worker runs its attention and block copies on the kernels under the CPU
# emulator (tests: the engine's scheduling scenarios over the CUDA-side code paths).
EMULATED_KERNELS_ENV = switches.EMULATED_KERNELS


def attention_layers(model: nn.Module) -> list[LayerAttention]:
    """The LayerAttention of every attention layer of `model`, in layer order."""
    return [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), LayerAttention)]


def kernel_attention(backend: object) -> KernelAttentionBackend | None:
    """`backend` when it is the CUDA kernels' (whose layers then run the CUDA ops), else None."""
    if getattr(backend, "name", None) != "kernels":
        return None
    from noria.kernels.attention_backend import KernelAttentionBackend

    return backend if isinstance(backend, KernelAttentionBackend) else None


@dataclass(frozen=True)
class AttentionChoice:
    """The start-up decision: the backend, its name for /health and `noria doctor` ("kernels"
    or "torch"), and why the kernels are not used for some or all layers ("" when they are for
    all, or when the worker is on a CPU, where torch with its native decode is the path)."""

    backend: AttentionBackend
    name: str
    reason: str = ""


def get_attention_backend(
    device: torch.device,
    layers: Sequence[LayerAttention] = (),
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    *,
    kernel_backend: Any = None,
    choice: AttentionBackendChoice = "auto",
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend `select_attention_backend` picks."""
    return select_attention_backend(device, layers, dtype, block_size, kernel_backend=kernel_backend,
                                    choice=choice, kv_dtype=kv_dtype).backend


def select_attention_backend(
    device: torch.device,
    layers: Sequence[LayerAttention] = (),
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    *,
    kernel_backend: Any = None,
    choice: AttentionBackendChoice = "auto",
    kv_dtype: torch.dtype | None = None,
) -> AttentionChoice:
    """`choice` is --attention-backend. auto: the kernel backend (with torch for the layers it
    cannot run) on a CUDA device, the torch backend elsewhere; kernels: the same, but a worker
    that cannot run them raises WorkerFatal (one sentence) instead of falling back; torch: the
    torch backend. `kernel_backend` (a kernels.backends.KernelBackend, e.g. the CPU emulator in
    tests) forces the kernel path on any device. `kv_dtype`: the KV cache's (None: the model's);
    with fp8 a layer runs on the kernels where they have its fp8 instances."""
    native = device.type == "cpu"
    if choice == "torch":
        log.info("attention: torch backend for every layer (--attention-backend torch)")
        return AttentionChoice(TorchAttentionBackend(native=native), "torch", "--attention-backend torch")
    if kernel_backend is None and device.type == "cpu" and switches.emulated_kernels():
        from noria.kernels.backends import EmuBackend

        kernel_backend = EmuBackend()
    if device.type != "cuda" and kernel_backend is None:
        if choice == "kernels":
            raise WorkerFatal(f"--attention-backend kernels needs a CUDA device with CuPy (`{CUDA_INSTALL_HINT}`), "
                              f"but this worker runs on {device.type}")
        return AttentionChoice(TorchAttentionBackend(native=native), "torch")
    try:
        from noria.kernels.attention_backend import KernelAttentionBackend

        kernels = KernelAttentionBackend(fallback=TorchAttentionBackend(native=False), backend=kernel_backend,
                                         kv_dtype=kv_dtype)
        kernels.warm_up(layers, dtype, block_size, device)
    except Exception as e:  # noqa: BLE001 - any failure of an optional dependency means: use torch
        what = "CuPy is not installed" if isinstance(e, ImportError) else "CuPy does not work here"
        why = f"{what} ({type(e).__name__}: {e})"
        if choice == "kernels":
            raise WorkerFatal(f"--attention-backend kernels cannot run: {why}; the CUDA kernels need "
                              f"`{CUDA_INSTALL_HINT}`") from e
        log.warning("attention: torch backend for every layer: %s; the CUDA kernels need `%s`",
                    why, CUDA_INSTALL_HINT)
        return AttentionChoice(TorchAttentionBackend(native=native), "torch", why)
    reasons = {i: kernels.unsupported(la, dtype, block_size) for i, la in enumerate(layers)}
    on_torch = {i: why for i, why in reasons.items() if why is not None}
    if layers and len(on_torch) == len(layers):
        why = _describe(on_torch)
        if choice == "kernels":
            raise WorkerFatal(f"--attention-backend kernels: no layer of this model runs on the kernels ({why})")
        log.warning("attention: torch backend for every layer: %s", why)
        return AttentionChoice(TorchAttentionBackend(native=native), "torch", why)
    if on_torch:
        why = f"torch for layers {_describe(on_torch)}"
        log.warning("attention: kernels for %d of %d layers, %s", len(layers) - len(on_torch), len(layers), why)
        return AttentionChoice(kernels, "kernels", why)
    log.info("attention: kernels for all %d layers", len(layers))
    return AttentionChoice(kernels, "kernels")


def _describe(reasons: dict[int, str | None]) -> str:
    """'0, 2, 4: head size 72 (...); 1: 6 query heads do not group evenly over 4 KV heads': layers
    grouped by reason."""
    by_reason: dict[str, list[int]] = {}
    for i, why in reasons.items():
        by_reason.setdefault(str(why), []).append(i)
    return "; ".join(f"{', '.join(map(str, ids))}: {why}" for why, ids in by_reason.items())
