"""An error is said once: the process that meets it logs it, the others pass it on, and a
one-shot command (`noria generate`) shows warnings and its final error line only, unless -v."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NO_CUDA = "torch on this host sees no CUDA device"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _generate(demo_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "noria.frontend.cli", "generate", "hi", "--model", str(demo_path),
            "--max-tokens", "2", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: --device cuda starts")


@needs_cpu_only
def test_a_start_up_error_is_one_line(demo_path: Path) -> None:
    r = _generate(demo_path, "--device", "cuda")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count(NO_CUDA) == 1, r.stderr
    assert not TIMESTAMP.search(r.stderr) and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("noria: error: start-up failed") and NO_CUDA in lines[-1], r.stderr
    assert all(line.startswith("noria: warning: ") for line in lines[:-1]), r.stderr


@needs_cpu_only
def test_verbose_shows_each_process_log_and_the_reason_in_the_worker_s_only(demo_path: Path) -> None:
    r = _generate(demo_path, "--device", "cuda", "-v")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    logged = [line for line in lines if TIMESTAMP.match(line)]
    assert any(" noria.scheduler.workers INFO " in line and "registered" in line for line in logged), r.stderr
    # Met by the worker: logged there; the worker group and the scheduler pass it on without it.
    with_reason = [line for line in logged if NO_CUDA in line]
    assert len(with_reason) == 1 and " noria.worker ERROR " in with_reason[0], r.stderr
    assert any(" noria.scheduler.workers ERROR " in line and "lost" in line for line in logged), r.stderr
    assert lines[-1].startswith("noria: error: start-up failed") and NO_CUDA in lines[-1], r.stderr


def test_a_quiet_run_prints_the_completion_only_and_verbose_names_the_cpu_op_paths(demo_path: Path) -> None:
    quiet = _generate(demo_path, "--device", "cpu")
    assert quiet.returncode == 0 and quiet.stdout.strip(), quiet.stderr
    # Nothing routine: a warning (say, a kernel that did not build) is all that may show.
    assert all(line.startswith("noria: warning: ") for line in quiet.stderr.splitlines()), quiet.stderr
    assert "cpu ops: " not in quiet.stderr
    verbose = _generate(demo_path, "--device", "cpu", "-v")
    assert verbose.returncode == 0, verbose.stderr
    paths = [line for line in verbose.stderr.splitlines() if "cpu ops: " in line]
    assert len(paths) == 1 and " noria.worker INFO " in paths[0], verbose.stderr
    assert re.search(r"cpu ops: gemm=\S+.* fused=\S+.* attention=\S+.* stack=\S+", paths[0]), paths[0]
    assert verbose.stdout == quiet.stdout  # greedy: the same completion


def test_brief_style_shows_warnings_without_time_or_traceback() -> None:
    code = """
import logging
from noria.protocol import logs
logs.setup(logs.BRIEF)
log = logging.getLogger("noria.x")
log.info("routine")
try:
    1 / 0
except ZeroDivisionError:
    log.warning("careful", exc_info=True)
log.error("passed on to the final line")
assert logs.child_args() == ["--log-style", "brief"]
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "noria: warning: careful\n", r.stderr
