"""Every NORIA_* environment switch: its name, meaning and the one function that reads it.

| switch | value | default | meaning |
|---|---|---|---|
| `NORIA_API_KEY` | key | none | the HTTP/websocket API key when neither `--api-key` nor `--api-key-file` is given; `noria serve` removes it from its environment, so no child process inherits it |
| `NORIA_CACHE` | folder | `$XDG_CACHE_HOME/noria`, else `~/.cache/noria` | the demo model, the built native CPU kernels (`cpu-kernels/`), bench's vLLM venv |
| `NORIA_KERNEL_CACHE` | folder | `~/.cache/noria/kernels` | the CUDA kernels compiled for the CPU emulator (`emu/`) |
| `NORIA_DISABLE_CPU_KERNELS` | `1` | off | every family of float32 CPU operators on torch instead of the native C kernels |
| `NORIA_DISABLE_CPU_GEMM`, `_FUSED`, `_ATTENTION`, `_STACK` | `1` | off | one family on torch (worker/cpu_ops.py) |
| `NORIA_CPU_BF16_WIDEN` | `1` | off | bf16-weight GEMMs widen W to float32 (float32 activations, float32 FMAs) even where AVX512_BF16's dot products (activations rounded to bf16) are built |
| `NORIA_CPU_NO_AMX` | `1` | off | the native GEMMs keep AVX-512's dot products (`vdpbf16ps` for bf16 weights, `vpdpbusd` for W8A8) even where AMX tiles are usable (an A/B of the two on one host, or a way round a host whose tiles misbehave) |
| `NORIA_CPU_W4A16` | `1` | off | 4- and 8-bit weight-only schemes (W4A16, W8A16, GGUF Q4_0 / Q4_K / Q8_0 / Q6_K) computed on float32 activations, as the checkpoint defines them, instead of on activations rounded to int8 per group of the weights' group size (llama.cpp's way: int8 dot products, 2-4x the rate on a CPU) |
| `NORIA_CPU_MARCH` | a GCC `-march` | `native` | the instruction set the native CPU kernels are built for, e.g. `x86-64-v3` to run the AVX2 code on an AVX-512 host (bench and tests of another host's path) |
| `NORIA_EMULATED_KERNELS` | `1` | off | a CPU worker runs the CUDA attention kernels in the CPU emulator |
| `NORIA_STEP_OBSERVER` | `module:callable` | none | the worker process calls it with each ModelRunner it builds, which may add to `runner.step_observers` (bench's step log installs itself so) |
| `NORIA_RECORD_STEPS` | file | none | where bench/step_log.py's observer writes one line per step (set both with `noria.bench.step_log.env(path)`) |
| `NORIA_VLLM_VENV` | folder | `$NORIA_CACHE/vllm-venv` | the virtual environment bench runs vLLM from |

Each function reads the environment when it is called, never at import: a process sees what
its parent passed it, and a test may set a switch with `monkeypatch.setenv`. A flag is on when
it is exactly `1`.

Stdlib only, in protocol/ because every folder may import protocol; kernels/ imports this one
module of it (for NORIA_KERNEL_CACHE), which keeps the cache folder's default in one place
instead of threading it through every caller of the emulator.

Variables of other programs stay where they are read: the emulator's `CUDAEMU_*`
(kernels/emu/module.py `EmuConfig.from_env`, kernels/emu/build.py), the compilers' `CXX` and
`CC`, torch's `GLOO_SOCKET_IFNAME` (worker/registration.py), CuPy's `CUPY_*`. The worker's
OpenMP and allocator settings are set by its entry point (worker/cli.py), not here.
"""

from __future__ import annotations

import os
from pathlib import Path

API_KEY = "NORIA_API_KEY"
CACHE = "NORIA_CACHE"
KERNEL_CACHE = "NORIA_KERNEL_CACHE"
DISABLE_CPU_KERNELS = "NORIA_DISABLE_CPU_KERNELS"
DISABLE_CPU_FAMILY = {
    "gemm": "NORIA_DISABLE_CPU_GEMM",
    "fused": "NORIA_DISABLE_CPU_FUSED",
    "attention": "NORIA_DISABLE_CPU_ATTENTION",
    "stack": "NORIA_DISABLE_CPU_STACK",
}
CPU_BF16_WIDEN = "NORIA_CPU_BF16_WIDEN"
CPU_NO_AMX = "NORIA_CPU_NO_AMX"
CPU_MARCH = "NORIA_CPU_MARCH"
CPU_W4A16 = "NORIA_CPU_W4A16"
EMULATED_KERNELS = "NORIA_EMULATED_KERNELS"
STEP_OBSERVER = "NORIA_STEP_OBSERVER"
RECORD_STEPS = "NORIA_RECORD_STEPS"
VLLM_VENV = "NORIA_VLLM_VENV"

# Every switch above, for the docs and the test that keeps this table complete.
SWITCHES: tuple[str, ...] = (API_KEY, CACHE, KERNEL_CACHE, DISABLE_CPU_KERNELS, *DISABLE_CPU_FAMILY.values(),
                             CPU_BF16_WIDEN, CPU_NO_AMX, CPU_MARCH, EMULATED_KERNELS, STEP_OBSERVER, RECORD_STEPS, VLLM_VENV)


def _flag(name: str) -> bool:
    return os.environ.get(name) == "1"


def _text(name: str) -> str | None:
    return os.environ.get(name) or None


def take_api_key() -> str | None:
    """$NORIA_API_KEY, removed from this process's environment so that no child inherits it."""
    return os.environ.pop(API_KEY, None) or None


def cache_dir() -> Path:
    """$NORIA_CACHE, else $XDG_CACHE_HOME/noria, else ~/.cache/noria."""
    base = _text(CACHE) or os.path.join(_text("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "noria")
    return Path(base)


def kernel_cache_dir() -> Path:
    """$NORIA_KERNEL_CACHE, else ~/.cache/noria/kernels."""
    env = _text(KERNEL_CACHE)
    return Path(env) if env else Path.home() / ".cache" / "noria" / "kernels"


def cpu_family_disabled(family: str) -> str | None:
    """The switch that puts a CPU operator family ("gemm", "fused", "attention", "stack") on
    torch, as "NAME=1", or None when the native kernels may run."""
    for name in (DISABLE_CPU_KERNELS, DISABLE_CPU_FAMILY[family]):
        if _flag(name):
            return f"{name}=1"
    return None


def cpu_bf16_widen() -> bool:
    """$NORIA_CPU_BF16_WIDEN=1: the bf16-weight GEMM widens W instead of AVX512_BF16 dot products."""
    return _flag(CPU_BF16_WIDEN)


def cpu_no_amx() -> bool:
    """$NORIA_CPU_NO_AMX=1: the native GEMMs keep AVX-512's dot products where AMX tiles are usable."""
    return _flag(CPU_NO_AMX)


def cpu_w4a16() -> bool:
    """$NORIA_CPU_W4A16=1: 4-bit weights multiply float32 activations, not int8-rounded ones."""
    return _flag(CPU_W4A16)


def cpu_march() -> str:
    """$NORIA_CPU_MARCH: the -march of the native CPU kernels' builds ("native" when unset or empty)."""
    return os.environ.get(CPU_MARCH) or "native"


def emulated_kernels() -> bool:
    """$NORIA_EMULATED_KERNELS=1: a CPU worker's attention runs the CUDA kernels in the emulator."""
    return _flag(EMULATED_KERNELS)


def step_observer() -> str | None:
    """$NORIA_STEP_OBSERVER: "package.module:callable", called with each ModelRunner the worker builds."""
    return _text(STEP_OBSERVER)


def record_steps() -> str | None:
    """$NORIA_RECORD_STEPS: the file bench/step_log.py writes the steps to."""
    return _text(RECORD_STEPS)


def vllm_venv() -> Path:
    """$NORIA_VLLM_VENV, else the cache folder's vllm-venv."""
    env = _text(VLLM_VENV)
    return Path(env) if env else cache_dir() / "vllm-venv"
