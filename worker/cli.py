"""`noria worker` (one worker rank on any host, registering with a scheduler's worker link)
and `noria doctor` (worker/doctor.py): their arguments.

Defined here (noria/cli.py puts them on the `noria` parser) because the frontend never
imports the worker. Nothing here imports torch: the worker loads it once registered, the
doctor when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os

# The worker process's settings of the libraries torch loads; a variable already set wins.
# Both are read once, when the library starts, so they must be in the environment before torch
# is imported: libgomp reads OMP_* in its load-time constructor, and torch's CPU allocator reads
# THP_MEM_ALLOC_ENABLE at its first allocation. Set by the entry point, not on import, so that
# importing noria never changes a host program's environment.
#
# OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=100000: the worker shares the host's cores with
# the scheduler and frontend processes, and OpenMP's default busy-wait between parallel regions
# fights them for the CPU (measured: decode steps 4-6x slower on 2 busy cores). Waiting
# passively from the first instant costs a futex wake-up per parallel region instead, some
# 80 per decode step, which at batch 1 was a third of the step (bf16 "small": 9.1 ms forward
# passive, 4.4 ms with a spin of 100,000 iterations, a fraction of a millisecond, enough to
# bridge the gaps between one step's kernels and not the gaps between steps). W1 gained too:
# 739 -> 810 tok/s (LLM), 716 -> 796 (served), bf16 on 2 cores.
# THP_MEM_ALLOC_ENABLE=1: transparent huge pages for torch's CPU allocations of 2 MB and more
# (the KV cache, the weights). Decode reads K/V through scattered blocks, and with 4 KB pages
# a TLB miss lands on nearly every block (measured on W1's replayed steps: about 5 % faster).
# Most kernels honour THP only for regions that ask for it (`enabled = madvise`), which is
# what this makes torch do.
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100000", "THP_MEM_ALLOC_ENABLE": "1"}


def set_process_env() -> None:
    """Put PROCESS_ENV into this process's environment (before torch is imported)."""
    for name, value in PROCESS_ENV.items():
        os.environ.setdefault(name, value)


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
    set_process_env()
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


def cmd_doctor(args: argparse.Namespace) -> int:
    set_process_env()  # the doctor runs kernels under torch in this process, as a worker would
    from noria.worker.doctor import cmd_doctor

    return cmd_doctor(args)


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="check this host: GPU, CuPy, kernel compile and contracts, a generation, bandwidth",
                       description="`noria doctor`: does this host run noria, and on a GPU, how fast does the "
                                   "decode kernel go.")
    d.add_argument("--quick", action="store_true",
                   help="GPU: contracts for the demo model's and two common shapes only (default: every instance)")
    d.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt in the generation check (default 16)")
    d.set_defaults(fn=cmd_doctor)
