"""Console-script entry point for `noria`: every folder's subcommands on one parser."""

from __future__ import annotations

import sys

from noria import bench
from noria.bench import doctor
from noria.frontend import cli as frontend_cli
from noria.worker import cli as worker_cli


def main(argv: list[str] | None = None) -> int:
    ap, sub = frontend_cli.parser()
    frontend_cli.add_commands(sub)
    worker_cli.add_command(sub)
    bench.add_command(sub)
    doctor.add_command(sub)
    return frontend_cli.run(ap, argv)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
