"""Which path each family of float32 CPU operators takes, decided here once per process.

Two paths per family, no more:

* native: the C kernels of worker/csrc, built at run time with the system compiler
  (worker/native_build.py): the fastest measured (bench/RESULTS.md);
* torch: torch's public operators (F.linear, the elementwise ops, SDPA; the decoder
  layers as Python modules). They are the reference the tests compare the native
  kernels with, and the fallback where no C compiler works.

The families: gemm (worker/gemm_kernels.py), fused elementwise steps
(worker/fused_kernels.py), paged decode attention (worker/cpu_kernels.py), and the
decoder stack in one call (worker/native_stack.py, which needs the other three).
Set to 1, NORIA_DISABLE_CPU_KERNELS puts every family on torch, NORIA_DISABLE_CPU_GEMM,
..._FUSED, ..._ATTENTION, ..._STACK one family each. Shapes or dtypes a kernel was not
built for take the torch path of their family, call by call.
"""

from __future__ import annotations

import logging

from noria.protocol import switches

log = logging.getLogger("noria.worker")

ALL_ENV = switches.DISABLE_CPU_KERNELS
FAMILY_ENV = switches.DISABLE_CPU_FAMILY
NATIVE = "native"

_logged = False


def disabled(family: str) -> str | None:
    """The environment switch that puts `family` on torch ("NORIA_DISABLE_CPU_GEMM=1"), or None."""
    return switches.cpu_family_disabled(family)


def paths() -> dict[str, str]:
    """Per family, "native" or "torch (why)". Builds the kernels not yet built (cached on disk)."""
    # Imported here: each kernel module asks `disabled` above when it loads.
    from noria.worker import cpu_kernels, fused_kernels, gemm_kernels, native_build, native_stack

    sources = {"gemm": gemm_kernels._SRC, "fused": fused_kernels._SRC, "attention": cpu_kernels._SRC,
               "stack": native_stack._SRC}
    loaded = {"gemm": gemm_kernels.load() is not None, "fused": fused_kernels.load() is not None,
              "attention": cpu_kernels.load() is not None, "stack": native_stack.load() is not None}
    out: dict[str, str] = {}
    for family, ok in loaded.items():
        if ok:
            out[family] = NATIVE
            continue
        why = disabled(family) or native_build.failure(sources[family])
        if why is None and family == "stack":
            why = "needs gemm, fused and attention native"
        out[family] = f"torch ({why or 'not built'})"
    return out


def summary() -> str:
    """One line: "cpu ops: gemm=native fused=native attention=native stack=native"."""
    return "cpu ops: " + " ".join(f"{family}={path}" for family, path in paths().items())


def log_once() -> None:
    """Log `summary()` at INFO, the first time only (a worker may load its model more than once)."""
    global _logged
    if not _logged:
        _logged = True
        log.info("%s", summary())
