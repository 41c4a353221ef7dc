"""`python -m noria.worker --config JSON --addresses JSON --rank N [--dist-init-method tcp://HOST:PORT]`:
run one worker rank."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from noria.protocol.config import EngineAddresses, EngineConfig
from noria.protocol.lifecycle import become_child


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.worker")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--addresses", required=True, help="EngineAddresses as JSON")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--dist-init-method", default=None,
                    help="torch.distributed rendezvous of the tensor-parallel ranks, e.g. tcp://127.0.0.1:PORT")
    ap.add_argument("--standalone", action="store_true", help="do not exit when the parent exits")
    args = ap.parse_args()
    if not args.standalone:
        become_child()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from noria.worker.process import run

    config = msgspec.json.decode(args.config, type=EngineConfig)
    addrs = msgspec.json.decode(args.addresses, type=EngineAddresses)
    return run(config, addrs, args.rank, args.dist_init_method)


if __name__ == "__main__":
    sys.exit(main())
