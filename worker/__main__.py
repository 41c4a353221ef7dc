"""`python -m noria.worker --connect ADDR [--rank R] [--model PATH] ...`: one worker rank as a
child of `noria serve` (it exits when its parent does); `noria worker` is the same rank for
any host, without that tie."""

from __future__ import annotations

import argparse
import logging
import sys

from noria.protocol.lifecycle import become_child
from noria.worker.cli import add_worker_args, cmd_worker


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.worker")
    add_worker_args(ap)
    ap.add_argument("--standalone", action="store_true", help="do not exit when the parent exits")
    args = ap.parse_args()
    if not args.standalone:
        become_child()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return cmd_worker(args)


if __name__ == "__main__":
    sys.exit(main())
