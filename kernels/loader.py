"""Compiles kernel modules with cupy.RawModule and caches them per process (CuPy also caches
the cubin on disk, keyed by source and options)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from noria.kernels.instances import ModuleSpec
from noria.kernels.options import SOURCE_DIR, compile_options, read_source


@functools.cache
def cupy_module(spec: ModuleSpec, source_dir: Path = SOURCE_DIR) -> Any:
    import cupy

    return cupy.RawModule(
        code=read_source(spec.source, source_dir),
        options=compile_options(source_dir),
        name_expressions=spec.names,
    )


@functools.cache
def cupy_kernel(spec: ModuleSpec, name: str, source_dir: Path = SOURCE_DIR) -> Any:
    if name not in spec.names:
        raise KeyError(f"{name} is not instantiated by {spec}")
    return cupy_module(spec, source_dir).get_function(name)
