"""`noria worker`: one worker rank on any host, registering with a scheduler's worker link.

Defined here (noria/cli.py puts it on the `noria` parser) because the frontend never
imports the worker. Nothing here imports torch: the worker loads it once registered.
"""

from __future__ import annotations

import argparse
import logging


def add_worker_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connect", required=True,
                    help="the scheduler's worker link, tcp://HOST:PORT (what `noria serve --worker-listen` binds)")
    ap.add_argument("--rank", type=int, default=0, help="tensor-parallel rank of this worker (default 0)")
    ap.add_argument("--model", default=None,
                    help="this host's path to the engine's checkpoint (checked against the engine's); "
                         "default: the path the scheduler names")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default: the engine's --device")
    ap.add_argument("--curve-keys", default=None, metavar="DIR",
                    help="CURVE keys: scheduler.key and this worker's pair (from `noria keygen`)")
    ap.add_argument("--scheduler-wait", type=float, default=60.0, metavar="S",
                    help="exit 1 after this many seconds without a scheduler (default 60)")


def cmd_worker(args: argparse.Namespace) -> int:
    from noria.worker.process import WorkerOptions, run

    logging.getLogger("noria").setLevel(logging.INFO)
    opts = WorkerOptions(connect=args.connect, rank=args.rank, model=args.model, device=args.device,
                         curve_keys=args.curve_keys, scheduler_wait=args.scheduler_wait)
    try:
        return run(opts)
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the scheduler sees the connection close and re-queues this rank's work


def add_command(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("worker", help="run one worker rank that registers with `noria serve --worker-listen`")
    add_worker_args(w)
    w.set_defaults(fn=cmd_worker)
