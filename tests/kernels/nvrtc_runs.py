"""Background NVRTC compile checks: one process per arch (NVRTC holds the GIL inside CuPy,
so threads would not overlap). conftest starts them as soon as the tests are collected, so
that they compile while the emulated tests run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from noria.kernels import nvrtc_check
from noria.kernels.options import ARCHS

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    arch: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path


RUNS_KEY = pytest.StashKey[list[Run]]()


def start() -> list[Run]:
    env = dict(os.environ, CUPY_CACHE_IN_MEMORY="1")  # never skip a compile on a cache hit
    tmp = Path(tempfile.mkdtemp(prefix="nvrtc-check-"))
    runs = []
    for arch in ARCHS:
        out, err = tmp / f"sm_{arch}.json", tmp / f"sm_{arch}.log"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", "noria.kernels.nvrtc_check", "--arch", arch, "--json"],
                cwd=ROOT,
                env=env,
                stdout=o,
                stderr=e,
            )
        runs.append(Run(arch, proc, out, err))
    return runs


def collect(runs: list[Run]) -> list[nvrtc_check.CompileRecord]:
    records = []
    try:
        for run in runs:
            rc = run.proc.wait(timeout=900)
            log = run.err.read_text()[-4000:]
            assert rc == 0, f"NVRTC check for sm_{run.arch} failed:\n{log}"
            for r in json.loads(run.out.read_text()):
                usage = [nvrtc_check.KernelUsage(**u) for u in r.pop("usage")]
                records.append(nvrtc_check.CompileRecord(**r, usage=usage))
    finally:
        for run in runs:
            shutil.rmtree(run.out.parent, ignore_errors=True)
    return records
