"""Compile every kernel instance through the NVRTC call cupy.RawModule makes, with no GPU.

RawModule compiles through cupy._core.core.compile_with_cache(code, options,
prepend_cupy_headers=False, backend='nvrtc', ..., name_expressions=...). Before compiling,
CuPy asks the device for its compute capability, which fails with no driver; we replace
those two (private, CuPy 14.2) lookups so the call goes through for a chosen arch. The cubin
is real; only loading it fails. ptxas' -v report in the NVRTC log gives registers, shared
memory and spills per kernel.

    python -m noria.kernels.nvrtc_check [--arch 80 90] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from noria.kernels import instances
from noria.kernels.options import ARCHS, PTXAS_VERBOSE, SOURCE_DIR, compile_options, read_source

CUPY_VERSION = "14.2.0"  # the private names patched below were checked on this version


@dataclass
class KernelUsage:
    arch: str
    source: str
    name: str  # the name expression
    registers: int
    shared_bytes: int  # static shared memory
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@dataclass
class CompileRecord:
    arch: str
    source: str
    nvrtc_options: list[str]
    log: str
    cubin_bytes: int
    usage: list[KernelUsage] = field(default_factory=list)


@contextlib.contextmanager
def offline_nvrtc(arch: str) -> Iterator[list[dict[str, Any]]]:
    """Make CuPy compile for `arch` without a device; yields the NVRTC calls it makes."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY") != "1":
        # Otherwise a cubin from CuPy's disk cache would skip the compile being checked.
        raise RuntimeError("set CUPY_CACHE_IN_MEMORY=1 so that every check really compiles")
    from cupy.cuda import compiler

    calls: list[dict[str, Any]] = []
    saved = (
        compiler._get_arch,
        compiler._get_arch_for_options_for_nvrtc,
        compiler._NVRTCProgram.compile,
    )
    original_compile = compiler._NVRTCProgram.compile

    def record(self: Any, options: Sequence[str] = (), log_stream: Any = None) -> Any:
        result = original_compile(self, options, log_stream)
        if self.src:  # CuPy first compiles an empty program to fingerprint the compiler
            calls.append({"options": list(options), "mapping": result[1], "binary": len(result[0])})
        return result

    compiler._get_arch = lambda: arch
    compiler._get_arch_for_options_for_nvrtc = lambda a=None: (f"-arch=sm_{a or arch}", "cubin")
    compiler._NVRTCProgram.compile = record
    try:
        yield calls
    finally:
        (
            compiler._get_arch,
            compiler._get_arch_for_options_for_nvrtc,
            compiler._NVRTCProgram.compile,
        ) = saved


def rawmodule_compile(code: str, options: tuple[str, ...], names: Sequence[str]) -> str:
    """Run RawModule's compile call; returns the NVRTC log. Compile errors raise
    cupy.cuda.compiler.CompileException; the missing driver only stops the module load."""
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    log = io.StringIO()
    with contextlib.suppress(CUDARuntimeError):
        cupy._core.core.compile_with_cache(
            code,
            options,
            prepend_cupy_headers=False,
            backend="nvrtc",
            translate_cucomplex=False,
            enable_cooperative_groups=False,
            name_expressions=tuple(names),
            log_stream=log,
            jitify=False,
        )
    return log.getvalue()


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(log: str, arch: str, source: str, mapping: dict[str, str]) -> list[KernelUsage]:
    by_mangled = {v: k for k, v in mapping.items()}
    usage: list[KernelUsage] = []
    current: dict[str, Any] | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = {"name": by_mangled.get(m.group(1), m.group(1))}
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), stores=int(m.group(2)), loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            usage.append(
                KernelUsage(
                    arch,
                    source,
                    current["name"],
                    int(m.group(1)),
                    int(m.group(2) or 0),
                    current.get("stack", 0),
                    current.get("stores", 0),
                    current.get("loads", 0),
                )
            )
            current = None
    return usage


def check(archs: Sequence[str] = ARCHS, source_dir: Path = SOURCE_DIR) -> list[CompileRecord]:
    records: list[CompileRecord] = []
    options = compile_options(source_dir) + PTXAS_VERBOSE
    for arch in archs:
        for source, names in instances.all_instances().items():
            with offline_nvrtc(arch) as calls:
                log = rawmodule_compile(read_source(source, source_dir), options, names)
            if len(calls) != 1:
                raise RuntimeError(f"expected one NVRTC compile for {source}, saw {len(calls)}")
            record = CompileRecord(arch, source, calls[0]["options"], log, calls[0]["binary"])
            record.usage = parse_ptxas(log, arch, source, calls[0]["mapping"] or {})
            records.append(record)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHS))
    parser.add_argument("--json", action="store_true", help="print records as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")
    records = check(args.arch)
    if args.json:
        json.dump([asdict(r) for r in records], sys.stdout)
        return 0
    spills = 0
    for r in records:
        for u in r.usage:
            spills += u.spill_stores + u.spill_loads
            print(
                f"sm_{u.arch} {u.name}: {u.registers} regs, {u.shared_bytes} B smem, "
                f"{u.stack_bytes} B stack, spills {u.spill_stores}/{u.spill_loads}"
            )
    return 1 if spills else 0


if __name__ == "__main__":
    raise SystemExit(main())
