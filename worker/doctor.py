"""`noria doctor`: does this host run noria, and on a GPU, how fast does the decode kernel go.

On a GPU host: CuPy and the device, every kernel instance compiled for the local arch (no
spills), the kernel contracts on the device against the float64 torch reference, a short
greedy generation on the GPU against the same generation on the CPU, and the decode kernel's
memory bandwidth against the device's peak and a device-to-device copy.
On a host without a GPU it says so and runs the CPU subset: an NVRTC compile of the demo
model's instances (where CuPy is installed), the contracts under the CPU emulator on a few
shapes, and a short generation on the emulated kernels against the torch backend.

Exit status 0 when every check passed, 1 otherwise (the failed checks are listed last).
It lives beside the worker because it drives the kernels and torch; the generations it
compares run the whole engine in a child (frontend/doctor_generation.py), since the worker
may not import the frontend's `LLM`. Its arguments are declared in worker/cli.py, so that
`noria --help` loads none of this.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Report:
    failed: list[str] = field(default_factory=list)
    passed: int = 0

    def line(self, status: str, name: str, detail: str = "") -> None:
        print(f"  {status:<5} {name}{': ' + detail if detail else ''}", flush=True)

    def check(self, name: str, fn: Callable[[], str]) -> bool:
        """Run one check: fn returns a detail line or raises with the reason it failed."""
        start = time.perf_counter()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            self.failed.append(name)
            self.line("FAIL", name, f"{type(e).__name__}: {e}")
            if not isinstance(e, AssertionError):
                traceback.print_exc(limit=4, file=sys.stdout)
            return False
        self.passed += 1
        self.line("ok", name, f"{detail} ({time.perf_counter() - start:.1f} s)")
        return True


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    report = Report()
    print(f"noria doctor: torch {torch.__version__}, Python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        from noria.worker.doctor_checks import gpu_checks

        gpu_checks(report, quick=args.quick, max_tokens=args.max_tokens)
    else:
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"no GPU: torch ({built}) sees no CUDA device; running the CPU/emulator subset")
        from noria.worker.doctor_checks import cpu_checks

        cpu_checks(report, max_tokens=args.max_tokens)
    if report.failed:
        print(f"noria doctor: {len(report.failed)} check(s) FAILED: {', '.join(report.failed)}")
        return 1
    print(f"noria doctor: all {report.passed} checks passed")
    return 0

