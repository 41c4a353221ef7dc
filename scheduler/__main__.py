"""`python -m noria.scheduler --config JSON --addresses JSON --link JSON`: run the scheduler process."""

from __future__ import annotations

import argparse
import sys

import msgspec

from noria.protocol import logs
from noria.protocol.config import EngineAddresses, EngineConfig, WorkerLinkConfig
from noria.protocol.lifecycle import become_child


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.scheduler")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--addresses", required=True, help="EngineAddresses as JSON")
    ap.add_argument("--link", default="{}", help="WorkerLinkConfig as JSON")
    ap.add_argument("--standalone", action="store_true", help="do not exit when the parent exits")
    ap.add_argument(logs.STYLE_FLAG, choices=logs.STYLES, default=logs.SERVICE, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.standalone:
        become_child()
    logs.setup(args.log_style)  # the style of the command that started this process
    from noria.scheduler.process import run

    config = msgspec.json.decode(args.config, type=EngineConfig)
    addrs = msgspec.json.decode(args.addresses, type=EngineAddresses)
    link = msgspec.json.decode(args.link, type=WorkerLinkConfig)
    return run(config, addrs, link)


if __name__ == "__main__":
    sys.exit(main())
