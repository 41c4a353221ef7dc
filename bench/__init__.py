"""Benchmarks: `noria bench NAME [args]` runs `noria.bench.NAME.main(argv)`."""

from __future__ import annotations

import argparse
import importlib

# The modules that are benchmarks; the others (workloads, ceiling, plots) are their helpers.
BENCHMARKS = ("generate", "scheduler", "serving", "throughput", "fuzz", "disconnects", "overload", "failover",
              "kernels", "soak", "structured", "ttft_idle")


def add_command(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="run a benchmark from bench/ (`noria bench NAME --help`)")
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported by its package name so that it runs from the installed script in any directory.
    mod = importlib.import_module(f"noria.bench.{args.name}")
    return int(mod.main(args.rest) or 0)
