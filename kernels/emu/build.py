"""Compile a generated wrapper into a shared library, cached by a hash of everything that
goes into the build (sources, headers in the include dirs, compiler, flags)."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from noria.protocol import switches

EMU_INCLUDE = Path(__file__).resolve().parent / "include"

# -fno-extern-tls-init: extern __shared__ arrays are extern thread_locals; without it g++
#   calls a TLS init wrapper that does not exist. -fno-gnu-unique: static __shared__ in
#   template kernels must not be merged across loaded modules. -fvisibility=hidden keeps
#   each module's template instances to itself. -fno-strict-aliasing: kernels type-pun
#   through 16-byte vector loads, which nvcc tolerates.
CXXFLAGS: tuple[str, ...] = (
    "-std=c++17",
    "-O1",  # compiles twice as fast as -O2 and runs the kernels as fast
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-fno-extern-tls-init",
    "-fno-gnu-unique",
    # Every load and store calls __asan_{load,store}*_noabort, which cudaemu/memcheck.h
    # defines: the bounds check of shared arrays and pointer arguments. No ASan runtime.
    "-fsanitize=kernel-address",
    "--param=asan-instrumentation-with-call-threshold=0",
    "--param=asan-stack=0",
    "--param=asan-globals=0",
)
_HEADER_SUFFIXES = (".h", ".cuh", ".hpp", ".inl")


class EmuBuildError(RuntimeError):
    """g++ rejected the source; the message carries its diagnostics."""


def cache_root() -> Path:
    """Where compiled modules live: under $NORIA_KERNEL_CACHE or ~/.cache/noria/kernels."""
    return switches.kernel_cache_dir() / "emu"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache
def _compiler_identity(cxx: str) -> str:
    path = shutil.which(cxx)
    if path is None:
        raise EmuBuildError(f"C++ compiler {cxx!r} not found (set CXX)")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True)
    return path + "\n" + out.stdout


def _headers(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.suffix in _HEADER_SUFFIXES)


def extra_flags() -> tuple[str, ...]:
    return tuple(os.environ.get("CUDAEMU_CXXFLAGS", "").split())


def build_key(wrapper: str, include_dirs: Sequence[Path], defines: Sequence[str]) -> str:
    h = hashlib.sha256()
    for part in (_compiler_identity(compiler()), *CXXFLAGS, *extra_flags(), *defines, wrapper):
        h.update(part.encode())
        h.update(b"\0")
    for d in (EMU_INCLUDE, *include_dirs):
        for p in _headers(d):
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:32]


def build(wrapper: str, include_dirs: Sequence[Path], defines: Sequence[str] = ()) -> Path:
    """Return the path of the shared library for `wrapper`, compiling it if not cached."""
    include_dirs = [Path(d).resolve() for d in include_dirs]
    key = build_key(wrapper, include_dirs, defines)
    out_dir = cache_root()
    target = out_dir / f"{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cudaemu-") as tmp:
        src = Path(tmp) / "module.cpp"
        src.write_text(wrapper)
        obj = Path(tmp) / "module.so"
        cmd = [
            compiler(),
            *CXXFLAGS,
            *extra_flags(),
            "-include",
            "cudaemu.h",
            f"-I{EMU_INCLUDE}",
            *(f"-I{d}" for d in include_dirs),
            *(f"-D{d}" for d in defines),
            str(src),
            "-o",
            str(obj),
            "-ldl",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmuBuildError(f"g++ failed ({proc.returncode}):\n{proc.stderr}")
        # Rename is atomic, so concurrent builders of the same key never see a partial file.
        fd, tmp_target = tempfile.mkstemp(dir=out_dir, prefix=f".{key}.", suffix=".tmp")
        os.close(fd)
        shutil.copyfile(obj, tmp_target)
        os.replace(tmp_target, target)
    return target
