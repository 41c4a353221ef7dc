"""Which attention backend the worker uses, decided once at start-up, per layer.

On a CUDA device the CuPy kernels (noria.kernels) run every layer whose shapes, dtype and
block size they were built for; the torch backend runs the rest. When CuPy is missing or
broken (no wheel, a wheel for another CUDA major, no NVRTC, a kernel that does not compile)
every layer runs on torch. Either way the worker logs one line saying what and why, and no
step ever reaches a kernel that was not built for its shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from noria.protocol import switches
from noria.worker.attention import AttentionBackend, LayerAttention, TorchAttentionBackend

log = logging.getLogger("noria.worker")

CUDA_INSTALL_HINT = "pip install noria[cuda]"
# Set to 1, a CPU worker runs its attention and block copies on the kernels under the CPU
# emulator (tests: the engine's scheduling scenarios over the CUDA-side code paths).
EMULATED_KERNELS_ENV = switches.EMULATED_KERNELS


def attention_layers(model: nn.Module) -> list[LayerAttention]:
    """The LayerAttention of every attention layer of `model`, in layer order."""
    return [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), LayerAttention)]


def get_attention_backend(
    device: torch.device,
    layers: Sequence[LayerAttention] = (),
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    *,
    kernel_backend: Any = None,
) -> AttentionBackend:
    """The kernel backend (with torch for the layers it cannot run) on a CUDA device, the
    torch backend elsewhere. `kernel_backend` (a kernels.backends.KernelBackend, e.g. the CPU
    emulator in tests) forces the kernel path on any device."""
    if kernel_backend is None and device.type == "cpu" and switches.emulated_kernels():
        from noria.kernels.backends import EmuBackend

        kernel_backend = EmuBackend()
    if device.type != "cuda" and kernel_backend is None:
        return TorchAttentionBackend()
    try:
        from noria.kernels.attention_backend import KernelAttentionBackend

        kernels = KernelAttentionBackend(fallback=TorchAttentionBackend(native=False), backend=kernel_backend)
        kernels.warm_up(layers, dtype, block_size, device)
    except Exception as e:  # noqa: BLE001 - any failure of an optional dependency means: use torch
        what = "CuPy is not installed" if isinstance(e, ImportError) else "CuPy does not work here"
        log.warning("attention: torch backend for every layer: %s (%s: %s); the CUDA kernels need `%s`",
                    what, type(e).__name__, e, CUDA_INSTALL_HINT)
        return TorchAttentionBackend(native=device.type == "cpu")
    reasons = {i: kernels.unsupported(la, dtype, block_size) for i, la in enumerate(layers)}
    on_torch = {i: why for i, why in reasons.items() if why is not None}
    if layers and len(on_torch) == len(layers):
        log.warning("attention: torch backend for every layer: %s", _describe(on_torch))
        return TorchAttentionBackend(native=device.type == "cpu")
    if on_torch:
        log.warning("attention: kernels for %d of %d layers, torch for layers %s",
                    len(layers) - len(on_torch), len(layers), _describe(on_torch))
    else:
        log.info("attention: kernels for all %d layers", len(layers))
    return kernels


def _describe(reasons: dict[int, str | None]) -> str:
    """'0, 2, 4: sliding window 4096 (...); 1: head size 72 (...)': layers grouped by reason."""
    by_reason: dict[str, list[int]] = {}
    for i, why in reasons.items():
        by_reason.setdefault(str(why), []).append(i)
    return "; ".join(f"{', '.join(map(str, ids))}: {why}" for why, ids in by_reason.items())
