"""Device and dtype resolution for the worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from noria.worker.errors import WorkerFatal

if TYPE_CHECKING:
    from noria.worker.models.parallel import TensorParallel

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
    """(the dtype the model computes in, the dtype its linear weights are kept in where that
    differs). On a CPU, bfloat16 and float16 mean 16-bit weights through the native GEMM over
    them with float32 activations: half float32's weight bytes, which decode reads every step;
    torch's half-precision operators (about half float32's speed here, float16 far slower) only
    where that GEMM does not build. The KV cache is in the second dtype where there is one, else
    the first (ModelRunner.kv_dtype): rounded as it is written and widened to float32 as
    attention reads it, half the bytes decode attention reads per token."""
    from noria.protocol import switches
    from noria.worker import gemm_bf16_kernels

    # Under the kernel emulator the CPU stands for a GPU: 16-bit stays 16-bit for its tensor-core kernels.
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not switches.emulated_kernels() \
            and gemm_bf16_kernels.load() is not None:
        return torch.float32, dtype
    return dtype, None


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None,
                  float32_bytes: Callable[[], int | None] | None = None) -> torch.dtype:
    """The dtype `--dtype name` runs in (see choose_dtype)."""
    return choose_dtype(name, device, checkpoint_dtype, float32_bytes).dtype


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the worker runs in and why (for `--dtype auto`, the start-up line says it)."""

    dtype: torch.dtype
    reason: str
    auto: bool = True

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def line(self, weight_dtype: torch.dtype | None = None) -> str | None:
        """The worker's start-up line: what auto chose and why, and on a CPU what bfloat16 turns
        into (cpu_precision's `weight_dtype`); None for a given dtype that needs no word."""
        if weight_dtype == torch.float16:
            precision = "f16 weights through the native f16 GEMM, f16 KV cache, float32 norms, rotary and softmax"
        else:
            precision = (f"bf16 weights through the native bf16 GEMM ({bf16_gemm()[0]}), bf16 KV cache, "
                         "float32 norms, rotary and softmax")
        if self.auto:
            return f"dtype auto: {self.name} ({self.reason})" + (f"; {precision}" if weight_dtype is not None else "")
        return f"dtype: {precision}" if weight_dtype is not None else None


# Beside float32 weights, what a CPU worker needs before they count as fitting: the default CPU KV
# cache (worker/kv_cache.py, DEFAULT_KV_CACHE_GIB), activations and the runtime.
FIT_SLACK = 1.1
FIT_RESERVE = 1 << 30
GiB = 1 << 30


def bf16_gemm() -> tuple[str | None, str]:
    """(the layout of the native bf16 GEMM this host runs, "") or (None, why it has none): "amx"
    (AMX-BF16 tiles), "dot" (vdpbf16ps on bf16-rounded activations) or "widen" (bf16 weights
    widened to float32)."""
    from noria.worker import gemm_bf16_kernels, native_build
    from noria.worker.cpu_ops import disabled

    if gemm_bf16_kernels.load() is None:
        return None, disabled("gemm") or native_build.failure(gemm_bf16_kernels._SRC) or "not built"
    return gemm_bf16_kernels.layout(), ""


def choose_dtype(name: str, device: torch.device, checkpoint_dtype: str | None,
                 float32_bytes: Callable[[], int | None] | None = None, *,
                 flags: frozenset[str] | None = None, available: int | None = None) -> DtypeChoice:
    """`--dtype name` for a checkpoint saved in `checkpoint_dtype` (config.json's, as torch spells it).

    A given dtype wins. `auto` on a GPU is the checkpoint's float16 / bfloat16, else float32. On a
    CPU it is the checkpoint's half dtype where the native GEMM over 16-bit weights builds (and,
    for float16, the CPU converts it in hardware: `flags`, default /proc/cpuinfo's), and float32
    otherwise, unless float32 weights (`float32_bytes()`, None: unknown) would not fit in the
    memory `available` (default: worker/host.py's): then the half dtype, whatever the speed.
    """
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
        return DtypeChoice(_DTYPES[name], f"--dtype {name}", auto=False)
    half = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    if checkpoint_dtype == "float32":
        return DtypeChoice(torch.float32, "the checkpoint's")
    if checkpoint_dtype not in half:
        said = f"checkpoint {checkpoint_dtype}" if checkpoint_dtype else "the checkpoint names no dtype"
        return DtypeChoice(torch.float32, said)
    if device.type != "cpu":
        return DtypeChoice(half[checkpoint_dtype], "the checkpoint's")
    return _cpu_half_checkpoint(checkpoint_dtype, float32_bytes, flags, available)


def _cpu_half_checkpoint(checkpoint_dtype: str, float32_bytes: Callable[[], int | None] | None,
                         flags: frozenset[str] | None, available: int | None) -> DtypeChoice:
    """A half checkpoint on a CPU: its dtype wherever the native GEMM over 16-bit weights builds
    (bench/RESULTS.md, "Half precision on the CPU": half the weight bytes made batch-1 decode
    1.6-2x faster than float32 and W1 1.05-1.2x, in vdpbf16ps, and widened to float32 FMAs in
    the AVX2 code too); float16 only where the CPU widens it in hardware (F16C, AVX-512F)."""
    from noria.protocol import switches
    from noria.worker import host

    flags = host.cpu_flags() if flags is None else flags
    dtype = torch.bfloat16 if checkpoint_dtype == "bfloat16" else torch.float16
    kind, missing = bf16_gemm()
    if switches.emulated_kernels():
        # The emulator stands the CPU in for a GPU: 16 bits would run on torch's slow half operators.
        why_not = f"the kernel emulator is on ({switches.EMULATED_KERNELS})"
    elif kind is None:
        why_not = f"the native 16-bit GEMM is not built ({missing})"
    elif dtype == torch.bfloat16:
        native = host.native_bf16(flags)
        how = (f"this CPU computes bf16 natively: {', '.join(native)}" if native else
               f"bf16 widened to float32 in registers (no {'/'.join(host.NATIVE_BF16_FLAGS)}), half the bytes")
        return DtypeChoice(dtype, f"the checkpoint's; {how}; bf16 GEMM: {kind}")
    elif host.f16_in_hardware(flags):
        return DtypeChoice(dtype, "the checkpoint's; f16 widened to float32 by vcvtph2ps "
                                  f"({', '.join(host.f16_in_hardware(flags))}), half the bytes")
    else:
        why_not = "this CPU has no float16 conversion in hardware (no f16c/avx512f)"
    too_big = _would_not_fit(float32_bytes, available)
    if too_big:  # half the bytes, whatever the speed
        return DtypeChoice(dtype, f"{too_big}; checkpoint {checkpoint_dtype}, {why_not}")
    return DtypeChoice(torch.float32, f"checkpoint {checkpoint_dtype}; {why_not}")


def _would_not_fit(float32_bytes: Callable[[], int | None] | None, available: int | None) -> str | None:
    """"float32 weights (30.1 GiB) would not fit in 22.0 GiB available", or None where they fit
    or either size is unknown."""
    from noria.worker import host

    need = float32_bytes() if float32_bytes is not None else None
    if not need:
        return None
    room = host.memory_available() if available is None else available
    if not room or need * FIT_SLACK + FIT_RESERVE <= room:
        return None
    return f"float32 weights ({need / GiB:.1f} GiB) would not fit in {room / GiB:.1f} GiB available"


def same_on_every_rank(choice: DtypeChoice, device: torch.device, tp: TensorParallel) -> DtypeChoice:
    """Rank 0's choice on every rank: CPU ranks on other hosts may see another CPU or other free
    memory, and the ranks of one model must compute in one dtype (a GPU's choice is the checkpoint's)."""
    if tp.size == 1 or not choice.auto or device.type != "cpu":
        return choice
    order = (torch.float32, torch.bfloat16, torch.float16)
    code = int(tp.broadcast_from_first(torch.tensor([order.index(choice.dtype)])).item())
    return choice if order[code] == choice.dtype else DtypeChoice(order[code], "rank 0's choice")
