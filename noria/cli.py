"""Console-script entry point for `noria`: every folder's subcommands on one parser.

Building the parser imports only the modules that declare arguments (frontend/cli.py,
worker/cli.py and this one): no torch, no benchmark, no engine. A subcommand's code loads
when that subcommand runs, so `noria --help` and `noria serve --help` answer at once.
"""

from __future__ import annotations

import argparse
import sys

from noria.frontend import cli as frontend_cli
from noria.worker import cli as worker_cli

# The benchmarks users run, as `noria bench NAME` (each is noria.bench.NAME, with a `main(argv)`);
# bench/'s other modules are their helpers. Named here so that the parser needs no import of bench.
BENCHMARKS = ("generate", "scheduler", "serving", "throughput", "fuzz", "disconnects", "overload", "failover",
              "kernels", "soak", "structured", "gpu", "routing", "pd", "spec")


def _bench(args: argparse.Namespace) -> int:
    from noria.bench import run

    return run(args.name, args.rest)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="run a benchmark from bench/ (`noria bench NAME --help`)")
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)


def build_parser() -> argparse.ArgumentParser:
    ap, sub = frontend_cli.parser()
    frontend_cli.add_commands(sub)
    worker_cli.add_command(sub)
    _add_bench(sub)
    worker_cli.add_doctor_command(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    return frontend_cli.run(build_parser(), argv)


__all__ = ["BENCHMARKS", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
