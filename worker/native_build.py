"""Build a worker/csrc C file into a shared library once, and load it.

The worker's native CPU kernels are compiled with the system C compiler and
-march=native at run time (no torch headers, about a second each), cached per
content hash, flags and CPU features, and called through ctypes on tensors' data
pointers. `build()` returns None where no compiler works, and `failure()` says why:
the callers then keep their torch paths (worker/cpu_ops.py decides and logs which).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from noria.protocol import switches

log = logging.getLogger("noria.worker")

# Why the last build of a source (by file name) gave no library.
_failures: dict[str, str] = {}


def cache_dir() -> Path:
    return switches.cache_dir() / "cpu-kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: -march=native code built on an AVX-512 host must not be
    loaded from a shared cache folder on an AVX2-only one (illegal instruction)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        import platform

        return platform.processor().encode()


def _text(src: Path, seen: set[Path] | None = None) -> bytes:
    """The source's bytes and those of the local headers it includes (`#include "name"`, beside it,
    recursively): the cached library is keyed by them all, so an edited header rebuilds it."""
    seen = set() if seen is None else seen
    seen.add(src)
    text = src.read_bytes()
    out = [text]
    for name in re.findall(rb'^\s*#\s*include\s*"([^"]+)"', text, flags=re.MULTILINE):
        header = src.parent / name.decode()
        if header not in seen and header.is_file():
            out.append(_text(header, seen))
    return b"".join(out)


def failure(src: Path) -> str | None:
    """Why `build(src, ...)` returned None ("no C compiler", "the build failed"), or None."""
    return _failures.get(src.name)


def build(src: Path, flags: list[str]) -> ctypes.CDLL | None:
    march = switches.cpu_march()  # another host's instruction set, where asked
    flags = [f"-march={march}" if f == "-march=native" else f for f in flags]
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        _failures[src.name] = "no C compiler"
        return None
    digest = hashlib.sha256(_text(src) + " ".join(flags).encode() + _cpu_flags()).hexdigest()[:16]
    lib = cache_dir() / f"{src.stem}-{digest}.so"
    tmp = None
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
                pass
            subprocess.run([cc, *flags, str(src), "-o", tmp.name, "-lm"], check=True, capture_output=True)
            os.replace(tmp.name, lib)  # atomic: concurrent workers never load half a file
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
        if isinstance(e, FileNotFoundError) and e.filename == cc:
            _failures[src.name] = f"no C compiler at {cc}"  # said once, in the worker's "cpu ops" line
            return None
        detail = e.stderr.decode(errors="replace").strip()[:2000] if isinstance(e, subprocess.CalledProcessError) else ""
        log.warning("native CPU kernels in %s unavailable, using torch: %s%s", src.name, e,
                    f"\n{detail}" if detail else "")
        _failures[src.name] = "the build failed"
        return None
    _failures.pop(src.name, None)
    return dll
