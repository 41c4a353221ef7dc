"""`python -m noria.worker --connect ADDR [--rank R] [--model PATH] ...`: one worker rank as a
child of `noria serve` (it exits when its parent does); `noria worker` is the same rank for
any host, without that tie."""

from __future__ import annotations

import argparse
import sys

from noria.protocol import logs
from noria.protocol.lifecycle import become_child
from noria.worker.cli import add_worker_args, cmd_worker


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.worker")
    add_worker_args(ap)
    ap.add_argument("--standalone", action="store_true", help="do not exit when the parent exits")
    ap.add_argument(logs.STYLE_FLAG, choices=logs.STYLES, default=logs.SERVICE, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.standalone:
        become_child()
    logs.setup(args.log_style)  # the style of the command that started this process
    return cmd_worker(args)


if __name__ == "__main__":
    sys.exit(main())
