"""Benchmarks: `noria bench NAME [args]` runs `noria.bench.NAME.main(argv)`.

The names are `BENCHMARKS` (declared in noria/cli.py, which builds the parser without
importing this package); the other modules here are their helpers.
"""

from __future__ import annotations

import importlib

from noria.cli import BENCHMARKS

__all__ = ["BENCHMARKS", "run"]


def run(name: str, argv: list[str]) -> int:
    # Benchmarks run models in this process (kernels, the ceiling replay) and start the
    # systems they compare (vLLM included) from it: all under the worker's OpenMP and
    # huge-page settings, set before torch loads.
    from noria.worker.cli import set_process_env

    set_process_env()
    # Imported by its package name so that it runs from the installed script in any directory.
    mod = importlib.import_module(f"noria.bench.{name}")
    return int(mod.main(argv) or 0)
